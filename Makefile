# Two commands for a fresh clone:
#   make run    set up .venv and generate from the shipped ling-demo model with NEXTN speculation (CPU)
#   make test   set up .venv with the dev extras and run the test suite (CPU)
PY := .venv/bin/python
PROMPT ?= def fibonacci(n):

.PHONY: setup setup-dev run test
setup:
	scripts/setup.sh
setup-dev:
	scripts/setup.sh dev
run: setup
	$(PY) -m ling_jax.generate --model models/ling-demo --prompt "$(PROMPT)" --max-new-tokens 200 \
	  --speculative-algorithm NEXTN --speculative-num-steps 5 --speculative-eagle-topk 1 \
	  --speculative-num-draft-tokens 6 --temperature 0.7 --top-p 0.9 --repetition-penalty 1.2 --seed 0
# -n 2 --dist loadfile: two pytest-xdist workers, each test file whole on one (its module fixtures built once)
test: setup-dev
	$(PY) -m pytest -n 2 --dist loadfile --timeout 1200 --durations=25 tests
