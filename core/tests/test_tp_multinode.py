"""Multi-node settings: launcher variables (torchrun, mpirun), cvserve's flags, and the refusal at start."""

from __future__ import annotations

import logging

import pytest

from cvllm.engine.config import EngineConfig
from cvllm.engine.tensor_parallel.multinode import MultiNodeError, NodeSettings, from_launcher_env, merge
from cvllm.server.cli import CliError, build_server_args

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_no_launcher():
    assert from_launcher_env({}) is None
    assert from_launcher_env({"MASTER_ADDR": "10.0.0.1"}) is None   # an address alone launches nothing


def test_torchrun():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert from_launcher_env(env) == NodeSettings(2, 1, "10.0.0.1", 29500, "torchrun's RANK/WORLD_SIZE")


def test_mpirun():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    settings = from_launcher_env(env)
    assert (settings.num_nodes, settings.node_rank, settings.master_addr, settings.master_port) == (4, 3, None, None)
    assert "mpirun" in settings.source


def test_torchrun_wins_over_an_inherited_mpi_allocation():
    env = {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"}
    assert (from_launcher_env(env).num_nodes, from_launcher_env(env).node_rank) == (2, 0)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "LOCAL_RANK=1: cvllm takes one process per node"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK=2"),
    ({"RANK": "two", "WORLD_SIZE": "2"}, "RANK='two': expected an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "node_rank must be in 0..1, got 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "master_port must be a port number"),
])
def test_launcher_errors(env, message):
    with pytest.raises(MultiNodeError, match=message):
        from_launcher_env(env)


def test_flags_fill_in_and_must_agree():
    launcher = NodeSettings(2, 1, "10.0.0.1", None, "torchrun's RANK/WORLD_SIZE")   # MASTER_PORT unset
    flags = NodeSettings(master_port=29600, source="flags")
    assert merge(flags, None, {"master_port"}) is flags
    merged = merge(flags, launcher, {"master_port"})
    assert (merged.num_nodes, merged.node_rank, merged.master_addr, merged.master_port) == (2, 1, "10.0.0.1", 29600)
    with pytest.raises(MultiNodeError, match="--num-nodes 3 disagrees with torchrun's RANK/WORLD_SIZE environment"):
        merge(NodeSettings(num_nodes=3), launcher, {"num_nodes"})
    assert merge(NodeSettings(num_nodes=2), launcher, {"num_nodes"}).num_nodes == 2   # agreeing is fine


def test_engine_config_fields():
    config = EngineConfig(model="m")
    assert (config.num_nodes, config.node_rank, config.master_addr, config.master_port) == (1, 0, None, None)
    with pytest.raises(ValueError, match="node_rank must be in 0..num_nodes-1"):
        EngineConfig(model="m", num_nodes=2, node_rank=2)
    with pytest.raises(ValueError, match="more than one node needs master_addr and master_port"):
        EngineConfig(model="m", num_nodes=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 \\(all ranks\\) does not split evenly over 2 nodes"):
        EngineConfig(model="m", num_nodes=2, tensor_parallel_size=3, master_addr="h", master_port=1)
    with pytest.raises(ValueError, match="one device per tensor-parallel rank of a node \\(2\\)"):
        EngineConfig(model="m", num_nodes=2, tensor_parallel_size=4, master_addr="h", master_port=1, device_ids=[0])


def test_the_engine_runs_on_node_zero_only(tmp_path):
    from cvllm import LLM

    with pytest.raises(ValueError, match="node_rank 1: the engine runs on node 0; on this node run `cvserve"):
        LLM(str(tmp_path / "never-opened"), num_nodes=2, node_rank=1, tensor_parallel_size=2, master_addr="h",
            master_port=1)


def test_cvserve_flags(model_dir, monkeypatch):
    w = ["--w", str(model_dir)]
    engine = build_server_args([*w, "--num-nodes", "1", "--node-rank", "0", "--master-addr", "10.0.0.1",
                                "--master-port", "29500"]).engine
    assert (engine.num_nodes, engine.node_rank, engine.master_addr, engine.master_port) == (1, 0, "10.0.0.1", 29500)
    nodes = ["--num-nodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    engine = build_server_args([*w, *nodes, "--d", "0,1"]).engine   # candle-vllm: --d is each node's devices
    assert (engine.num_nodes, engine.tensor_parallel_size, engine.device_ids) == (2, 4, (0, 1))
    engine = build_server_args([*w, *nodes, "--tensor-parallel-size", "4"]).engine   # vLLM: all ranks
    assert (engine.tensor_parallel_size, engine.device_ids) == (4, None)
    assert build_server_args([*w, *nodes]).engine.tensor_parallel_size == 2   # one rank a node
    with pytest.raises(CliError, match="is 2 device\\(s\\) on each of 2 node\\(s\\), but --tensor-parallel-size is 2"):
        build_server_args([*w, *nodes, "--d", "0,1", "--tensor-parallel-size", "2"])
    with pytest.raises(CliError, match="--num-nodes 2 needs --master-addr and --master-port"):
        build_server_args([*w, "--num-nodes", "2"])
    with pytest.raises(CliError, match="node_rank must be in 0..0, got 1"):
        build_server_args([*w, "--node-rank", "1"])
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    monkeypatch.setenv("MASTER_PORT", "29501")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    engine = build_server_args(w).engine   # a one-node torchrun launch fills the fields in
    assert (engine.num_nodes, engine.master_addr, engine.master_port) == (1, "10.0.0.9", 29501)
    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = build_server_args(w).engine   # torchrun --nnodes 2: node 0 of 2, one rank each
    assert (engine.num_nodes, engine.node_rank, engine.tensor_parallel_size) == (2, 0, 2)


@pytest.mark.parametrize("argv, message", [
    (["--num-nodes", "0"], "expected a positive integer"),
    (["--master-port", "0"], "expected a port number (1-65535)"),
    (["--node-rank", "-1"], "expected an integer >= 0"),
])
def test_cvserve_flag_usage_errors(model_dir, capsys, argv, message):
    with pytest.raises(SystemExit):
        build_server_args(["--w", str(model_dir), *argv])
    assert message in capsys.readouterr().err


def test_multithread_is_accepted_and_says_why(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="cvllm.cvserve")
    args = build_server_args(["--w", str(model_dir), "--d", "0,1", "--multithread"])
    assert args.engine.tensor_parallel_size == 2
    assert "--multithread: running each tensor-parallel rank as its own process instead" in caplog.text
    caplog.clear()
    build_server_args(["--w", str(model_dir)])
    assert "--multithread" not in caplog.text
