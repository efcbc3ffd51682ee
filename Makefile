# Two entry points: `make demo` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
export TMPDIR := $(CURDIR)/.tmp

.PHONY: demo test venv system-deps lint typecheck clean

# Every tool run from here writes its temp files under .tmp, so it must exist before the first
# of them (postgresql-15's post-install script fails on a TMPDIR that is missing).
$(TMPDIR):
	mkdir -p $(TMPDIR)

$(BIN)/python: | $(TMPDIR)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch goes in first and pinned: the CPU wheel on these machines. A later unpinned request
# would otherwise pull a several-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[trainer,hf,lightning,postgres,dev]' $(TORCH)
	touch $(STAMP)

venv: $(STAMP)

# The test suite needs real Prometheus, promtool, amtool and PostgreSQL 15 binaries. A first
# install can stop in postgresql-15's configure step (seen here: dpkg exit 1, its service may not
# start in a container); finishing the configuration and installing again completes it.
system-deps: | $(TMPDIR)
	@if ! command -v promtool >/dev/null || ! command -v amtool >/dev/null \
	    || [ ! -x /usr/lib/postgresql/15/bin/initdb ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  PKGS="prometheus prometheus-alertmanager postgresql-15"; \
	  $$SUDO apt-get update -qq && { DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends $$PKGS >/dev/null \
	  || { DEBIAN_FRONTEND=noninteractive $$SUDO dpkg --configure -a \
	       && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$PKGS; }; }; \
	fi

demo: $(STAMP) | $(TMPDIR)
	$(BIN)/runhealth demo

# Two pytest workers, each taking whole test files: two files side by side on CI's two cores.
# Measured in clean worktrees of 5989976: -n 2 818.6 s, -n 3 940 s (the suite is mostly CPU:
# torch imports and trainings in many processes). Module fixtures stay
# shared within their file. Files go out longest first (tests/scheduling.py; refresh its
# seconds with `make test PYTEST_ARGS=--durations=0 > log` and `scripts/file_seconds.py log`);
# xdist's own reorder by test count would send the few-test end-to-end files last. Every
# end-to-end test waits for events with wall-clock deadlines and passes with two busy
# processes beside it (scripts/stress_suite.py).
test: $(STAMP) system-deps | $(TMPDIR)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --basetemp=$(TMPDIR)/pytest -p no:cacheprovider \
	  -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint:
	$(BIN)/ruff check monitor collectors policies migrations tests benchmarks
	$(BIN)/lint-imports

typecheck:
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .tmp
