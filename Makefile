# The README's two commands; each first installs whatever is missing.
#   make serve   torch (the CPU wheel, unless a torch is installed already), the packages and the demo model,
#                then `cvserve` on http://127.0.0.1:2000/v1 (ARGS="--w path/to/model" serves another)
#   make test    the same with the test extras, then the whole suite, the demo model's end-to-end tests included
# Inside an active virtual environment they install there; otherwise into .venv here (made if missing).
# An install is redone only when a pyproject.toml changed; `make clean` forgets it.

VENV := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
PACKAGES := ./core ./plugins/models-llama ./plugins/models-qwen ./plugins/models-deepseek ./plugins/models-phi \
            ./plugins/models-gemma ./plugins/models-glm ./plugins/models-stablelm ./plugins/quant-gguf ./plugins/quant-marlin \
            ./plugins/quant-fp8 ./plugins/backend-cuda ./plugins/backend-metal
# The packages with the extras their tests need (transformers, gguf, the Triton the CPU interpreter runs, ...)
TEST_PACKAGES := ./core[test] ./plugins/models-llama ./plugins/models-qwen[test] ./plugins/models-deepseek[test] \
                 ./plugins/models-phi[test] ./plugins/models-gemma[test] ./plugins/models-glm[test] ./plugins/models-stablelm[test] \
                 ./plugins/quant-gguf[test] ./plugins/quant-marlin[test] ./plugins/quant-fp8[test] \
                 ./plugins/backend-cuda[test] ./plugins/backend-metal[test]
PYPROJECTS := $(wildcard core/pyproject.toml plugins/*/pyproject.toml)

.PHONY: serve test install install-test clean

serve: $(VENV)/.installed
	$(BIN)/cvserve $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest core/tests plugins/*/tests examples/*/tests $(ARGS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(BIN)/python:
	python3 -m venv $(VENV)

# torch first, so that pip takes the CPU wheel rather than a multi-GB CUDA build (a GPU machine's own torch stays)
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install torch==2.13.0
	touch $@

$(VENV)/.installed: $(VENV)/.torch $(PYPROJECTS)
	$(BIN)/python -m pip install $(foreach p,$(PACKAGES),-e $(p))
	$(BIN)/cvllm fetch-demo
	touch $@

$(VENV)/.installed-test: $(VENV)/.torch $(PYPROJECTS)
	$(BIN)/python -m pip install $(foreach p,$(TEST_PACKAGES),-e "$(p)")
	$(BIN)/cvllm fetch-demo
	touch $@ $(VENV)/.installed

clean:
	rm -f $(VENV)/.torch $(VENV)/.installed $(VENV)/.installed-test
