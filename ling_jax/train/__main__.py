"""`python -m ling_jax.train ...`: see ling_jax.train.trainer."""

from ling_jax.train.trainer import main

if __name__ == "__main__":
    main()
