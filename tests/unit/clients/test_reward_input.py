"""remote.reward_input: tokens when the reward server's tokenizer and layout are the policy's, text
when they differ, the user's choice when forced; tokenizer mismatches the critic cannot live with
are refused naming both tokenizers."""

from __future__ import annotations

import pytest

from openaligner.clients.critic import (
    RemoteCriticConfig,
    TokenizerIdentity,
    TokenizerMismatchError,
    choose_reward_input,
)
from openaligner.config import ConfigError, load_config

POLICY = TokenizerIdentity("the tokenizer in policy-A", "fp-A", "vocab-A")
SAME = TokenizerIdentity("the tokenizer in rm-A", "fp-A", "vocab-A")
OTHER_LAYOUT = TokenizerIdentity("the tokenizer in rm-A-chat", "fp-A-chat", "vocab-A")
OTHER = TokenizerIdentity("the tokenizer in rm-B", "fp-B", "vocab-B")


def choose(mode, reward, critic=POLICY, combined=False):
    return choose_reward_input(mode, POLICY, reward=reward, critic=critic, combined=combined)


def test_auto_picks_tokens_for_the_same_tokenizer_and_text_otherwise():
    assert choose("auto", SAME) == "tokens"
    assert choose("auto", OTHER) == "text"
    assert choose("auto", OTHER_LAYOUT) == "text"  # same ids, laid out differently in training
    assert choose("auto", None) == "tokens"  # the server has no tokenizer: ids, as before


def test_the_user_can_force_either():
    assert choose("tokens", OTHER) == "tokens"
    assert choose("text", SAME) == "text"
    with pytest.raises(TokenizerMismatchError, match="has no tokenizer"):
        choose("text", None)


def test_combined_with_a_reward_tokenizer_other_than_the_policys_is_refused_naming_both():
    with pytest.raises(TokenizerMismatchError) as e:
        choose("auto", None, critic=OTHER, combined=True)
    assert "rm-B" in str(e.value) and "policy-A" in str(e.value)
    assert "combine_rm_and_critic_server=false" in str(e.value)
    assert "serve-critic model.path=<the policy's SFT directory>" in str(e.value)
    with pytest.raises(TokenizerMismatchError, match="needs a separate reward model server"):
        choose("text", None, combined=True)
    assert choose("auto", None, critic=SAME, combined=True) == "tokens"


def test_a_critic_with_another_tokenizer_is_refused_naming_both():
    with pytest.raises(TokenizerMismatchError) as e:
        choose("auto", OTHER, critic=OTHER)
    assert "rm-B" in str(e.value) and "policy-A" in str(e.value) and "critic" in str(e.value)
    # what works: the policy's backbone with a fresh value head, not the policy's tokenizer on
    # another model's embeddings (serve-critic tokenizer.path=<policy>)
    assert "serve-critic model.path=<the policy's SFT directory>" in str(e.value)
    assert "serve-critic tokenizer.path" not in str(e.value)
    # the critic only needs the ids to mean the same: another layout or template is fine
    assert choose("auto", OTHER, critic=OTHER_LAYOUT) == "text"
    assert choose("auto", OTHER, critic=None) == "text"  # a critic that says nothing is not refused


def test_the_config_key_is_checked():
    assert load_config(RemoteCriticConfig, None, ["reward_input=AUTO"]).reward_input == "auto"
    with pytest.raises(ConfigError, match="reward_input must be one of auto, tokens, text"):
        load_config(RemoteCriticConfig, None, ["reward_input=ids"])


def test_the_client_asks_both_servers_and_refuses_a_critic_of_another_tokenizer():
    from openaligner.clients.critic import RemoteGPTRMCriticClient

    def described(identity):
        return lambda *model: {
            "name": identity.name,
            "fingerprint": identity.fingerprint,
            "vocab_fingerprint": identity.vocab_fingerprint,
        }

    cfg = RemoteCriticConfig(combine_rm_and_critic_server=False)
    client = RemoteGPTRMCriticClient(cfg)
    try:
        client._critic.tokenizer = described(POLICY)  # type: ignore[method-assign]
        client._rm.tokenizer = described(OTHER)  # type: ignore[method-assign,union-attr]
        assert client.configure_reward_input(POLICY, lambda batch: []) == "text"
        client._critic.tokenizer = described(OTHER)  # type: ignore[method-assign]
        with pytest.raises(TokenizerMismatchError, match=r"rm-B.*policy-A"):
            client.configure_reward_input(POLICY, lambda batch: [])
    finally:
        client.close()


def test_combined_with_the_same_ids_laid_out_otherwise_is_refused_unless_forced():
    """The combined reward model would score the policy's ids in a layout it was not trained on."""
    with pytest.raises(TokenizerMismatchError) as e:
        choose("auto", None, critic=OTHER_LAYOUT, combined=True)
    assert "rm-A-chat" in str(e.value) and "policy-A" in str(e.value)
    assert "remote.reward_input=tokens" in str(e.value)
    assert choose("tokens", None, critic=OTHER_LAYOUT, combined=True) == "tokens"
