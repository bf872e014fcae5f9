# Two commands: `make run` (install, plan ViT-24 on the paper's heterogeneous testbed, then
# train a small VGG19 on the local emulated cluster, its slow device taking its share, priced
# from node times calibrated on this machine once and cached in .hap-cache/) and `make test` (install, then the whole
# test suite). Everything lives in ./.venv.
VENV   := .venv
PY     := $(VENV)/bin/python
# Pinned: on a CPU machine any other torch spec pulls gigabytes of CUDA wheels.
TORCH  := torch==2.13.0

.PHONY: install run test bench bench-runtime bench-fidelity bench-stragglers bench-automap bench-all bench-quick clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	mkdir -p out
	$(VENV)/bin/hap plan --model vit --layers 24 --cluster paper-hetero-8 --json out/plan-vit24.json
	OMP_NUM_THREADS=1 $(VENV)/bin/hap train --model vgg19 --scale small --hidden 64 --batch 64 --cluster local --calibrate --steps 30

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest --durations=15  # (the slowest tests, to keep the suite under 20 minutes on 2 cores)

bench: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/synthesis_time.py

bench-runtime: install    # measured: hap vs DP-EV vs DP-CP on the local cluster, hap vs DDP
	OMP_NUM_THREADS=1 $(PY) benchmarks/runtime_speed.py --node-timing --out out/bench-runtime

bench-fidelity: install   # estimated vs measured iteration time over 22 variants, scatter plot
	$(PY) -m pip install -q matplotlib
	OMP_NUM_THREADS=1 $(PY) benchmarks/fidelity.py --out out/bench-fidelity

bench-automap: install   # the pipeline DQN against the exact cut on the paper models: out/bench-automap/report.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/automap.py --out out/bench-automap

bench-stragglers: install   # straggler mitigation on the digits ViT, Table I, figures: out/bench-stragglers/report.md (74 min measured; --quick 7.5)
	OMP_NUM_THREADS=1 $(PY) benchmarks/stragglers.py --out out/bench-stragglers

bench-all: install     # every benchmark, one Markdown report with plots: out/bench/report.md (14.7 min measured)
	$(PY) -m pip install -q matplotlib
	OMP_NUM_THREADS=1 $(PY) benchmarks/all.py --out out/bench

bench-quick: install   # the same, smaller sweeps (under 10 min): out/bench-quick/report.md
	$(PY) -m pip install -q matplotlib
	OMP_NUM_THREADS=1 $(PY) benchmarks/all.py --quick --out out/bench-quick

clean:
	rm -rf $(VENV) out
