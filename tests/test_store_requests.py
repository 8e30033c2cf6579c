"""benchmarks/store_requests.py's pure parts: etcd's Prometheus counters read per gRPC method, and the difference
between two readings."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling module report.py
_spec = importlib.util.spec_from_file_location("store_requests", ROOT / "benchmarks" / "store_requests.py")
store_requests = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("store_requests", store_requests)
_spec.loader.exec_module(store_requests)

# as etcd 3.4 prints them (two codes of one method, two services, a stream, a histogram line, comments)
METRICS = """\
# HELP grpc_server_handled_total Total number of RPCs completed on the server, regardless of success or failure.
# TYPE grpc_server_handled_total counter
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 120
grpc_server_handled_total{grpc_code="NotFound",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 3
grpc_server_handled_total{grpc_code="OK",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 40
grpc_server_handled_total{grpc_code="OK",grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 2
grpc_server_handling_seconds_bucket{grpc_method="Range",le="0.005"} 99
process_cpu_seconds_total 12.5
"""


def test_requests_are_summed_per_method_over_codes_and_cpu_is_read():
    handled, cpu = store_requests.parse_metrics(METRICS)
    assert handled == {"Range": 123.0, "Txn": 40.0, "LeaseKeepAlive": 2.0}
    assert cpu == 12.5


def test_the_difference_keeps_the_methods_called_in_between():
    before, _ = store_requests.parse_metrics(METRICS)
    after = dict(before, Range=200.0, Put=7.0)
    assert store_requests.difference(before, after) == {"Range": 77, "Put": 7}


def test_a_job_without_its_step_count_is_refused():
    assert store_requests.steps_of(["x.toml", "--training.steps", "12"]) == 12
    with pytest.raises(SystemExit, match="--training.steps"):
        store_requests.steps_of(["x.toml"])
