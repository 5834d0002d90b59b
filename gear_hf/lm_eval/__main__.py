"""`python -m gear_hf.lm_eval ...` and the `gear-lm-eval` console script (`gear_hf.lm_eval.__main__:main`)."""

from gear_hf.lm_eval.cli import main

if __name__ == "__main__":
    main()
