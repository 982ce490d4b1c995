"""routing_floor_bytes: the bytes per device each residual mode must keep beyond baseline
(sources that survive to the backward pass, one cotangent buffer), checked against numbers
worked out by hand."""

import importlib.util
import os

import numpy as np

from deltares.training.memory import routing_floor_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20


def experiment(name, arg):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def test_floor_of_7b6_on_eight_devices():
    """s7b6: batch 64 x 2048, d 4096, bfloat16, 36 layers, blocks of 6; 8 devices, FSDP 8.
    One slot per device: 8 rows x 2048 x 4096 x 2 B = 128 MiB."""
    floor = routing_floor_bytes(experiment("s7b6", "delta_block"), 8)
    assert floor["baseline"]["total_bytes"] == 0 and floor["baseline"]["live_slots"] == 0
    # delta: 73 slots, the last delta read by nobody: 72 x 128 MiB = 9 GiB of sources, 9 GiB cotangent
    d = floor["delta"]
    assert (d["n_slots"], d["live_slots"]) == (73, 72)
    assert d["slot_shape_per_device"] == (8, 2048, 4096)
    assert d["sources_bytes"] == 9_663_676_416 and d["cotangent_bytes"] == 9_663_676_416
    assert d["total_bytes"] == 19_327_352_832  # 18 GiB
    assert d["total_bytes_float32_cotangent"] == 28_991_029_248  # 9 + 18 GiB
    # full AttnRes: the output routing reads every slot, 73 x 128 MiB twice
    assert floor["full_attnres"]["total_bytes"] == 19_595_788_288
    # block modes: 6 blocks + the embedding = 7 slots, 896 MiB each of sources and cotangent
    for mode in ("delta_block", "block_attnres"):
        f = floor[mode]
        assert (f["n_slots"], f["live_slots"]) == (7, 7), mode
        assert f["total_bytes"] == 1_879_048_192 and f["dtype"] == "bfloat16", mode  # 1792 MiB
        assert f["total_bytes_float32_cotangent"] == 2_818_572_288, mode  # 896 + 1792 MiB


def test_floor_of_debug_split_over_fsdp_and_tensor():
    """debug: batch 4 x 32, d 32, float32, 3 layers, blocks of 2 (the last of one layer); mesh
    data 1, fsdp 2, tensor 2: a slot per device is 2 rows x 32 x 16 x 4 B = 4096 B."""
    cfg = experiment("debug", "delta_block")
    floor = routing_floor_bytes(cfg, {"data": 1, "fsdp": 2, "tensor": 2})
    assert floor["delta_block"]["slot_shape_per_device"] == (2, 32, 16)
    assert floor["delta_block"]["total_bytes"] == 24_576  # 3 slots (the last block's partial is read)
    assert floor["block_attnres"]["total_bytes"] == 24_576
    assert floor["delta"]["total_bytes"] == 49_152  # 6 of 7 slots
    assert floor["full_attnres"]["total_bytes"] == 57_344  # 7 slots
    assert floor["baseline"]["total_bytes"] == 0
    # without the partial the last block's slot is read only by block AttnRes' output routing
    cfg.model.residual.include_partial = False
    floor = routing_floor_bytes(cfg, {"data": 1, "fsdp": 2, "tensor": 2}, cotangent_dtype=np.float16,
                                modes=("delta_block", "block_attnres"))
    assert set(floor) == {"delta_block", "block_attnres"}
    assert floor["delta_block"]["live_slots"] == 2
    assert floor["delta_block"]["total_bytes"] == 8192 + 4096  # float32 sources, float16 cotangent
    assert floor["block_attnres"]["total_bytes"] == 12_288 + 6144


def test_floor_micro_batches_and_a_jax_mesh():
    cfg = experiment("debug", "delta")
    cfg.train.micro_batches = 2  # the buffer holds one micro-batch: 2 of the 4 rows
    import jax

    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:1])
    assert routing_floor_bytes(cfg, mesh)["delta"]["slot_shape_per_device"] == (2, 32, 32)
    # one row per device: 32 x 32 x 4 B = 4 KiB per slot, 6 live slots, sources and cotangent
    assert routing_floor_bytes(cfg, {"fsdp": 2})["delta"]["total_bytes"] == 49_152
