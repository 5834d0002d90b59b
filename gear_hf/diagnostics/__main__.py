"""`python -m gear_hf.diagnostics` (see gear_hf.diagnostics.cli)."""

from gear_hf.diagnostics.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
