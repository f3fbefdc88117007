# Every target sets itself up on a fresh machine: a virtualenv in .venv with the
# CPU build of torch pinned for these machines, cloudckpt with its test extras, and
# the test rigs (testkit/: local servers, fault proxy, thread ranks).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-localstack lint compat matrix bench torture install-check gpu-check clean

$(VENV)/.installed: pyproject.toml testkit/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps -e testkit  # the test rigs, not shipped in the wheel
	touch $@

# Azurite, the Azure Storage emulator the az:// tests start on 127.0.0.1 (node and npm
# are on these machines; testkit's AzuriteServer finds it here).
AZURITE_PIN ?= azurite@3.37.0
.azurite/.installed:
	npm install -q --no-audit --no-fund --prefix .azurite "$(AZURITE_PIN)"
	touch $@

# LocalStack's own S3 provider, the second S3 implementation the S3-facing tests run
# against (testkit's LocalStackServer): it needs CPython 3.12+, so it has a virtualenv of
# its own on one that testkit/localstack-python finds (about a minute). The pins are
# those pip does not find by itself for this release.
LOCALSTACK_PIN ?= localstack-core[runtime]==2026.3.0
LOCALSTACK_VENV ?= .venv-localstack
$(LOCALSTACK_VENV)/.installed: testkit/localstack-python
	rm -rf $(LOCALSTACK_VENV)
	"$$(testkit/localstack-python)" -m venv $(LOCALSTACK_VENV)
	$(LOCALSTACK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCALSTACK_VENV)/bin/python -m pip install -q "$(LOCALSTACK_PIN)" "cbor2<6" \
		"pyopenssl<25" "cryptography<45" "service_identity<26"
	touch $@

setup: $(VENV)/.installed .azurite/.installed $(LOCALSTACK_VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

lint: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports  # the layers in pyproject.toml: no upward imports
	$(PY) -m mypy  # the library's types, [tool.mypy] in pyproject.toml

# Two workers, each with its own servers: most tests wait on subprocesses and loopback
# servers, so two share the two cores well (about 19 minutes instead of 25).
test: lint
	$(PY) -m pytest -q -n 2 --dist worksteal --ignore=tests/compat --ignore=tests/gpu

# The S3-facing tests again, against LocalStack's S3 instead of moto: two S3
# implementations, each catching what the other lets through (docs/reliability.md).
# The files of what rests on S3's behaviour: conditional writes, claims and leases,
# commits, takeovers, multipart uploads and copies, coordination, crashes, gc, slots,
# faults, exit flushes, interrupts, DCP, the manager, resumes, the README; of them,
# tests/conftest.py keeps the tests that reach the S3 server (about 340). The framework
# integrations, tiers and replicas rest on those and run on moto only (make test).
LOCALSTACK_TESTS ?= tests/test_localstack_server.py tests/test_conditional.py \
	tests/test_claim.py tests/test_lease.py tests/test_checkpoint.py tests/test_takeover.py \
	tests/test_multipart.py tests/test_transfer.py tests/test_coordination.py \
	tests/test_crash.py tests/test_gc.py tests/test_slot.py tests/test_faults.py \
	tests/test_faultproxy_keepalive.py tests/test_faultproxy_headers.py \
	tests/test_s3_recovery.py tests/test_exit_flush.py tests/test_interrupts.py \
	tests/test_dcp.py tests/test_dcp_dropin.py tests/test_manager.py tests/test_resume.py \
	tests/test_readme.py tests/test_storage.py tests/test_store_gone.py \
	tests/test_torn_parts.py tests/test_own_checkpoints.py tests/test_rootindex.py \
	tests/test_save_checks.py tests/test_disagreeing_objects.py tests/test_incremental.py \
	tests/test_uri_paths.py tests/test_user_mistakes.py tests/test_versioned_buckets.py \
	tests/torture/test_network.py tests/torture/test_concurrency.py
test-localstack: setup
	$(PY) -m pytest -q -n 2 --dist worksteal --s3-servers=localstack $(LOCALSTACK_TESTS)

# The frameworks' own code driving cloudckpt: AReaL, RLinf and verl from PyPI (--no-deps: they
# declare GPU stacks and older torch; tests/compat/requirements.txt has what their
# checkpoint, trainer and strategy modules import), ROLL's and RLinf's upstream code
# from ../shared/peers. The torch pin is repeated so that nothing replaces it.
AREAL_PIN ?= areal==1.0.4
RLINF_PIN ?= rlinf==0.3.0
VERL_PIN ?= verl==0.9.1
$(VENV)/.compat: $(VENV)/.installed tests/compat/requirements.txt
	$(PY) -m pip install -q --no-deps "$(AREAL_PIN)" "$(RLINF_PIN)" "$(VERL_PIN)"
	$(PY) -m pip install -q "$(TORCH_PIN)" -r tests/compat/requirements.txt
	touch $@

# Two workers here too: the suite waits on subprocesses and servers (about 8 minutes instead
# of 14); .ci/run runs it beside `make matrix` and `make install-check`.
compat: $(VENV)/.compat
	$(PY) -m pytest -q -n 2 --dist worksteal tests/compat

# The torch matrix: the tests of what depends on torch's internals (DCP, the manager and
# restores, serialization, HF exports, incremental saves, activation, the README, and
# cloudckpt.compat's internals) again on the next torch, in a virtualenv of its own. The
# package index here has torch 2.14.1 as a CUDA build only; it runs on CPU, but imports
# only with its nvidia libraries (libtorch_cuda links them), so it is installed whole:
# about a minute for torch from the local index, 5 minutes for the whole virtualenv
# (6 GB) on a busy 2-core machine, then the tests. The pin is repeated so
# that nothing replaces it.
MATRIX_TORCH_PIN ?= torch==2.14.1
MATRIX_VENV ?= .venv-torch2.14
MATRIX_PY := $(MATRIX_VENV)/bin/python
MATRIX_TESTS ?= tests/test_private_api.py tests/test_dcp.py tests/test_dcp_dropin.py \
	tests/test_tensor_kinds.py tests/test_budget.py tests/test_state.py \
	tests/test_checkpoint.py tests/test_manager.py tests/test_incremental.py tests/test_hf.py \
	tests/test_activation.py tests/test_readme.py tests/test_dcp_indexed.py \
	tests/test_dcp_rankload.py tests/test_dcp_rules.py tests/test_dcp_records_read.py \
	tests/test_devicecopy.py
$(MATRIX_VENV)/.installed: pyproject.toml testkit/pyproject.toml
	$(PYTHON) -m venv $(MATRIX_VENV)
	$(MATRIX_PY) -m pip install -q --upgrade pip
	$(MATRIX_PY) -m pip install -q "$(MATRIX_TORCH_PIN)"
	$(MATRIX_PY) -m pip install -q "$(MATRIX_TORCH_PIN)" -e ".[test]"
	$(MATRIX_PY) -m pip install -q --no-deps -e testkit
	touch $@

matrix: $(MATRIX_VENV)/.installed .azurite/.installed
	$(MATRIX_PY) -c 'import torch; assert torch.__version__.startswith("$(patsubst torch==%,%,$(MATRIX_TORCH_PIN))"), torch.__version__'
	$(MATRIX_PY) -m pytest -q -n 2 --dist worksteal $(MATRIX_TESTS)

# The reliability and security torture suite at full scale (910 SIGKILLs among the rest;
# 20-35 minutes on 2 cores); prints a summary table and writes it to torture-report.json.
# Then the crash torture through the frameworks' own save paths under activation (the
# compat packages; 110 SIGKILLs per framework, about 50 minutes), one JSON line per
# framework in torture-frameworks.jsonl; and AReaL's SFTTrainer killed and relaunched at
# one rank too (the regular compat run launches it at two).
torture: setup $(VENV)/.compat
	CLOUDCKPT_TORTURE=full CLOUDCKPT_TORTURE_REPORT=torture-report.json \
		$(PY) -m pytest tests/torture -q -p no:cacheprovider -o timeout=1800
	rm -f torture-frameworks.jsonl
	CLOUDCKPT_TORTURE=full CLOUDCKPT_TORTURE_REPORT=torture-frameworks.jsonl \
		$(PY) -m pytest tests/compat/test_framework_torture.py -q -s -p no:cacheprovider \
		-o timeout=3600
	CLOUDCKPT_TORTURE=full $(PY) -m pytest -q -p no:cacheprovider \
		"tests/compat/test_areal_trainer.py::test_sft_trainer_killed_and_relaunched_resumes_from_the_bucket"

bench: setup
	$(PY) benchmarks/storage_bench.py
	$(PY) benchmarks/dcp_bench.py
	$(PY) benchmarks/manager_bench.py
	$(PY) benchmarks/tier_bench.py
	$(PY) benchmarks/incremental_bench.py
	$(PY) benchmarks/gcs_stream_bench.py
	$(PY) benchmarks/transfer_bench.py
	$(PY) benchmarks/hf_bench.py
	$(PY) benchmarks/hf_bench.py --max-shard-size 20MB
	$(PY) benchmarks/contents_bench.py
	$(PY) benchmarks/scale_sim.py
	$(PY) -m pip install -q "$(TORCH_PIN)" s3torchconnector multi-storage-client obstore  # peers only
	$(PY) benchmarks/memory_bench.py
	$(PY) benchmarks/peers_bench.py

# The GPU staging checks, at most 8 minutes (benchmarks/gpu_check.py): its CPU tests
# always; on a CUDA machine tests/gpu and benchmarks/gpu_bench.py too, otherwise it
# says the GPU part was not run. A GPU machine has no network, so it uses the python
# given (GPU_PY, default .venv's where there is one), with torch for CUDA, as it is.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py

# A user's `pip install .` (no extras) and `pip install ".[hf]"`, each into a fresh
# virtualenv with torch: fails when either uses over 180 s of CPU to resolve and install,
# then pip check, a smoke test and the console script (see .ci/install_check).
install-check:
	PYTHON="$(PYTHON)" TORCH_PIN="$(TORCH_PIN)" .ci/install_check

clean:
	rm -rf $(VENV) $(MATRIX_VENV) $(LOCALSTACK_VENV) .azurite .pytest_cache .ruff_cache .mypy_cache
