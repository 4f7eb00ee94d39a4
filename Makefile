# Every target installs what it needs first, so a fresh clone needs nothing but python3.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Every install is held to the CPU build of torch this machine carries: a looser torch makes pip fetch a
# several-GB CUDA build and its NVIDIA wheels.
PIN := $(VENV)/torch-pin.txt
# verl 0.9.1 (the verl extra), for loom.integrations.verl and its tests. verl caps transformers below 5.11 and
# this venv runs 5.24; the parts of verl Loom meets (DataProto, core_algos, the agent loop, the PPO trainer's
# advantage, reward and metric functions) import and run on 5.24 (measured), so verl comes without its pins, as
# do tensordict and pyvers (whose packaging<26 cap would move pip's own packaging back). The rest is what those
# parts import, resolved as usual; ray[default]'s extras, wandb and tensorboard serve a real cluster's run.
# TransferQueue is where verl's v1 trainer reads its rollouts from; it too asks for ray[default], so it comes
# without its pins, and pyzmq (its transport) is resolved with the rest.
VERL_NODEPS := verl==0.9.1 'tensordict>=0.8,<=0.10,!=0.9.0' pyvers==0.1.0 TransferQueue==0.1.11
VERL_DEPS := 'ray>=2.41' 'hydra-core>=1.3' codetiming cachetools dill peft torchdata cloudpickle orjson pyzmq
# SkyRL 0.3.0, for the test that has its trainer write the rollout dump `loom trace import skyrl` reads (Loom
# reads the dump without SkyRL). Its core pins transformers to 5.8 at most (and peft 0.18.1), its trainer extra asks for vLLM and
# flash-attn; the parts that build and dump a training batch import and run beside this venv's packages
# (measured) given jaxtyping, so it comes without its pins.
SKYRL_NODEPS := skyrl==0.3.0
SKYRL_DEPS := jaxtyping
# GEM (gem-llm 0.1.0, `"env": "gem:<env_id>"`, loom.envs.adapters.gem) pins math-verify[antlr4_13_2], whose
# antlr4-python3-runtime 4.13.2 cannot sit beside the 4.9 of verl's hydra and skyrl-gym's omegaconf, and
# reasoning-gym 0.1.23, msgspec 0.19.0 and nltk 3.9.1. So it has a venv of its own, which `loom up` starts a
# GEM-only environment manager from: Loom without extras, GEM with its pins, and what GEM's math environment
# imports without declaring it (datasets, pylatexenc). pip compiles no bytecode (the manager imports little of
# torch's stack); what the manager imports is compiled as it is first imported, below. It builds in 35 s to 95 s
# here (the latter beside other jobs). The .gitignore inside keeps it out of git, as .venv is.
GEM_VENV ?= .venv-gem
GEM_PY := $(GEM_VENV)/bin/python
GEM_STAMP := $(GEM_VENV)/.installed-stamp
GEM_DEPS := gem-llm==0.1.0 datasets==5.2.0 pylatexenc==2.11

.PHONY: install test lint unit demo up clean

$(STAMP): pyproject.toml examples/loom-guess/pyproject.toml examples/vf-calc/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	echo 'torch==2.13.0' > $(PIN)
	$(PY) -m pip install -q -c $(PIN) -e '.[dev,trl,reasoning_gym,skyrl_gym,textarena,verifiers]'
	$(PY) -m pip install -q -c $(PIN) --no-deps $(VERL_NODEPS)
	$(PY) -m pip install -q -c $(PIN) $(VERL_DEPS) $(SKYRL_DEPS)
	$(PY) -m pip install -q -c $(PIN) --no-deps $(SKYRL_NODEPS)
	# The example environments, installed as an operator installs a user's package (tests run jobs on them).
	$(PY) -m pip install -q --no-deps --no-build-isolation -e examples/loom-guess -e examples/vf-calc
	touch $(STAMP)

$(GEM_STAMP): pyproject.toml | $(STAMP)
	python3 -m venv $(GEM_VENV)
	echo '*' > $(GEM_VENV)/.gitignore
	$(GEM_PY) -m pip install -q --upgrade pip
	$(GEM_PY) -m pip install -q --no-compile -c $(PIN) -e . $(GEM_DEPS)
	# What GEM registers, kept in the venv for the scheduler (which never imports GEM) to read. Bytecode is written
	# for what that and the environment manager import (PYTHONDONTWRITEBYTECODE, where set, would have every GEM
	# manager `loom up` starts compile them again: importing GEM then takes 2 s of CPU instead of 7, measured).
	PYTHONDONTWRITEBYTECODE= $(GEM_PY) -W ignore -m loom.envs.adapters.gem > /dev/null
	PYTHONDONTWRITEBYTECODE= $(GEM_PY) -c 'import services.envmgr.__main__'
	touch $(GEM_STAMP)

install: $(STAMP) $(GEM_STAMP)

# Lint needs the dev venv alone, so that `make test` runs mypy, whose cold cache takes minutes, while GEM's venv
# builds.
lint: $(STAMP)
	$(VENV)/bin/ruff check libs services cli tests examples
	$(VENV)/bin/ruff format --check libs services cli tests examples
	$(VENV)/bin/mypy libs/loom services cli/loom_cli

# The slowest tests are listed at the end, so that CI's log shows where its minutes go. Loom's own modules are
# compiled first: where PYTHONDONTWRITEBYTECODE is set (as in CI), every service, worker and CLI call the tests
# start would compile what it imports from source again (about 0.4 s of CPU for a service, measured); Python
# checks each file against its source, so a stale one is never used.
test: $(STAMP)
	$(MAKE) -j2 lint install
	$(PY) -m compileall -q libs cli services examples tests > /dev/null
	$(VENV)/bin/pytest -q -ra --durations=30

unit: install
	$(VENV)/bin/pytest -q -ra tests/unit

demo: install
	$(VENV)/bin/loom demo

up: install
	$(VENV)/bin/loom up

clean:
	rm -rf $(VENV) $(GEM_VENV) .loom .pytest_cache .mypy_cache .ruff_cache
