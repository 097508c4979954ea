"""``python -m openaligner`` is the ``openaligner`` command (also under torchrun)."""

from openaligner.cli.main import entry

if __name__ == "__main__":
    raise SystemExit(entry())
