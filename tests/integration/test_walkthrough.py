"""docs/real-model.md's walkthrough, run as written: its prompt/SFT/RL/evaluation commands are read
out of the document's code blocks (sections 2-5) and run in one bash process chain, with a tiny
stand-in for Gemma and a few steps — so that the commands a newcomer copies work (the paths
agree, serve-reward's ready line is awaited and the server stopped, evaluate-task reads both
splits and an intermediate checkpoint, the plain-transformers snippet runs).

What is substituted, and why (nothing else is touched):

* ``$MODEL``: a tiny GPT-2 with the char tokenizer (``make real-model``'s Gemma exceeds CI);
* ``source .venv/bin/activate``: a stand-in that puts this interpreter's ``openaligner`` first on
  PATH (CI's venv is not in the temporary directory the test runs in);
* step counts and intervals: 2 steps (``step_12`` → ``step_2``), so it stays a smoke run;
* ``data.seq_length`` / ``remote.pad_to_length`` 80 → 160: the char tokenizer spends one token per
  character, Gemma's about one per word;
* port 5555 → a free port (tests run side by side).

The PPO block (``train-ppo ...``, a sketch of the GRPO command's differences) is not run: the
critic server's commands are run by tests/integration/test_real_gemma.py and the PPO tests.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import build_char_tokenizer

# every stage starts its own process (about ten): minutes on 2 busy cores
pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "real-model.md"
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def walkthrough_blocks(text: str) -> list[tuple[str, str]]:
    """The (language, code) blocks of sections 2-5, in order, without the PPO sketch."""
    body = text[text.index("## 2. ") : text.index("## SFT, measured")]
    blocks = [(lang, code) for lang, code in BLOCK.findall(body)]
    return [(lang, c) for lang, c in blocks if "train-ppo ..." not in c and "serve-critic" not in c]


def substituted(code: str, port: int) -> str:
    code = re.sub(r"trainer\.max_steps=\d+", "trainer.max_steps=2", code)
    code = re.sub(r"trainer\.save_interval=\d+", "trainer.save_interval=2", code)
    code = code.replace("trainer.val_check_interval=12", "trainer.val_check_interval=2")
    code = code.replace("step_12", "step_2")
    code = code.replace("data.seq_length=80", "data.seq_length=160")
    code = code.replace("remote.pad_to_length=80", "remote.pad_to_length=160")
    return code.replace("5555", str(port))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_walkthrough_runs_as_written(tmp_path):
    model = tmp_path / "tiny-gemma-stand-in"
    tokenizer = build_char_tokenizer()
    size = TinySize(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, max_positions=256)
    build_tiny_causal_lm("gpt2", size, seed=0).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    activate = tmp_path / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')

    blocks = walkthrough_blocks(DOC.read_text())
    assert [lang for lang, _ in blocks][:2] == ["python", "bash"], "section 2's data, then section 3's SFT"
    assert "source .venv/bin/activate" in DOC.read_text()
    port = _free_port()
    script = ["set -euo pipefail", "source .venv/bin/activate", f"export MODEL={model}"]
    for i, (lang, code) in enumerate(blocks):
        code = substituted(code, port)
        script.append(f"echo '### block {i}'")
        script.append(f"python - <<'PYTHON'\n{code}PYTHON" if lang == "python" else code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])

    runs = tmp_path / "runs" / "real"
    for name in ("train", "heldout", "unseen", "sft"):
        assert (runs / f"{name}.jsonl").is_file()
    assert (runs / "sft" / "merged" / "config.json").is_file()  # $SFT, the RL stage's start
    assert (runs / "grpo" / "actor" / "merged" / "config.json").is_file()  # section 5's path
    assert (runs / "grpo" / "checkpoints" / "step_2" / "actor" / "adapter_config.json").is_file()
    evaluations = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"model"')]
    assert len(evaluations) == 4  # base, SFT, the GRPO result, its step-2 checkpoint over $SFT
    for e in evaluations:
        assert sorted(e["splits"]) == ["heldout", "unseen"]
        for split in e["splits"].values():
            assert split["prompts"] == 128 and 0.0 <= split["exact_greedy"] <= 1.0
            assert len(split["examples"]) == 4
    assert "kl_to_reference" in evaluations[1]["splits"]["unseen"]
    assert "train-ppo: GRPO, steps 0 → 2;" in done.stdout
    printed = done.stdout.split("### block")[-1].splitlines()[1:]
    assert len(printed) == 4 and all("expected" in line for line in printed), printed
