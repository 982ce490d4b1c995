"""The ahead-of-time GPU compile (`python -m deltares.aot --gpu h100|h200[:N]`): XLA's CUDA compiler
(requirements-cuda-compiler.txt, which .ci/run installs in the virtual environment's cuda-compiler/
folder) builds the real train step for one GPU, or sharded over N, on this CPU-only machine.

The compiles run in subprocesses, through `aot.analyze` and the command line, so that the CUDA
plugin is never registered in the test process beside its CPU backend (and the TPU compiler of
tests/test_aot.py). A compile of the debug train step takes about 12 s here.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from deltares import aot
from deltares.training import gpu_aot
from tests.jax_cache import ENV, ROOT, run_module

TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'  # a Pallas Triton kernel in jax 0.10 (a Mosaic GPU
# kernel, the other Pallas GPU backend, is a different custom call: MOSAIC_CALL)
MOSAIC_CALL = re.compile(r'custom_call_target="mosaic_gpu(_v2)?"')


def _compiler_installed() -> bool:
    return any(_has_plugin(base) for base in [gpu_aot.compiler_dir(), *sys.path])


def _has_plugin(base: str) -> bool:
    return bool(base) and os.path.isfile(os.path.join(base, "jax_plugins", "xla_cuda12", "xla_cuda_plugin.so"))


needs_cuda_compiler = pytest.mark.skipif(
    not _compiler_installed() and not os.environ.get("CI"),  # in CI it must be there (.ci/run): fail, not skip
    reason="XLA's CUDA compiler is not installed (requirements-cuda-compiler.txt, see .ci/run)",
)


# Runs in a subprocess (one process, one GPU compiler): `aot.analyze` for the debug train step with the
# routing kernel and without, and sharded over 2 GPUs ("fsdp2": --gpu h100:2, XLA's routing), each report
# printed with what the compiled program's HLO text holds.
COMPILES = """if True:
    import importlib.machinery, json, sys
    from deltares import aot
    texts, attention = [], []
    count = aot.pallas_kernel_calls
    aot.pallas_kernel_calls = lambda text: texts.append(text) or count(text)
    eqn_flops = aot.fused_attention_eqn_flops  # each cuDNN attention equation the traced step's FLOPs count
    aot.fused_attention_eqn_flops = lambda eqn: attention.append((eqn.primitive.name, eqn_flops(eqn))) or attention[-1][1]
    experiment = importlib.machinery.SourceFileLoader("debug", "experiments/debug.py").load_module()
    for label, impl, group in (("pallas", "pallas", 0), ("xla", "xla", 0), ("two_phase", "pallas", 2),
                               ("auto_bf16", "auto", 0), ("fsdp2", "xla", 0)):
        cfg = experiment.get_config("delta_block")
        cfg.model.residual.impl = impl  # --config.model.residual.impl=...
        cfg.model.residual.group_layers = group
        cfg.model.remat = "full" if group else cfg.model.remat  # two-phase routing: the store-once pass
        if label == "auto_bf16":  # the defaults: "auto" attention (cuDNN in bf16 on a GPU) and "auto" routing
            cfg.model.dtype, cfg.model.attention = "bfloat16", "auto"
        texts.clear()
        report = aot.analyze(cfg, None, config_name="experiments/debug.py:delta_block",
                             gpu="h100:2" if label == "fsdp2" else "h100", estimate=label not in ("two_phase", "fsdp2"),
                             vs_baseline=label == "xla")  # baseline compiled after it, for the ratio
        hlo = texts[0]  # the compiled train step (an out-of-memory report would have none)
        lines = [line for line in hlo.splitlines() if sys.argv[1] in line]
        prefix_calls = sum("depth_route_prefix" in line for line in lines)  # phase one's K-query kernels
        cudnn_calls = hlo.count('custom_call_target="__cudnn$fmha')
        report["hlo_collectives"] = {op: hlo.count(op) for op in ("all-gather", "reduce-scatter", "all-reduce")}
        report["traced_attention"] = attention[:]
        attention.clear()
        print(json.dumps(dict(impl=label, report=report, triton_calls=len(lines), prefix_calls=prefix_calls,
                              cudnn_calls=cudnn_calls)), flush=True)
"""


@pytest.fixture(scope="module")
def h100_compiles():
    """{impl: (report, Triton kernel calls in the optimized HLO, those of phase one's kernels, cuDNN attention
    calls)} for impl pallas and xla, "two_phase" (pallas, residual.group_layers=2, remat full),
    "auto_bf16" (the "auto" routing and attention in bf16) and "fsdp2" (xla, on 2 H100s); with the GPU
    step-time estimate but for "two_phase" and "fsdp2", and for "xla" baseline's too (the ratio to it). Each
    report holds `hlo_collectives`: how often the names of the collectives stand in the compiled program's HLO."""
    proc = subprocess.run([sys.executable, "-c", COMPILES, TRITON_CALL], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "using the xla implementation" not in proc.stderr  # the kernel did not fall back
    assert "Error reading persistent compilation cache" not in proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            out[item["impl"]] = item["report"], item["triton_calls"], item["prefix_calls"], item["cudnn_calls"]
    assert set(out) == {"pallas", "xla", "two_phase", "auto_bf16", "fsdp2"}, proc.stdout
    return out


@needs_cuda_compiler
def test_fused_routing_is_a_triton_kernel_of_the_h100_train_step(h100_compiles):
    """impl=pallas: the depth-routing kernel of kernels_pallas/depth_route/pallas_gpu.py (forward and
    backward) is compiled into the H100 train step."""
    report, triton_calls, prefix_calls, _ = h100_compiles["pallas"]
    assert prefix_calls == 0
    assert triton_calls >= 2 and report["pallas_kernel_calls"] == triton_calls
    assert report["routing_impl"] == "pallas" and report["gpu"] == "h100" and report["topology"] is None
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["devices"] == 1
    assert report["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert (report["global_batch"], report["seq_len"]) == (4, 32)  # the experiment's own batch
    for key in ("per_device_bytes", "argument_bytes", "output_bytes", "temp_bytes", "hbm_bytes", "flops_per_step"):
        assert report[key] > 0, key
    assert report["per_device_bytes"] == (report["argument_bytes"] + report["output_bytes"] - report["alias_bytes"]
                                          + report["temp_bytes"] + report["code_bytes"])
    assert report["alias_bytes"] > 0.9 * report["argument_bytes"]  # the donated state is written in place
    assert report["hbm_bytes"] == gpu_aot.device_memory_bytes("h100") == 84942979072  # 79.1 GiB
    assert report["hbm_source"] == "target_config"
    assert report["fits"] is True and report["per_device_bytes"] < 2**30
    assert report["flops_per_step"] == pytest.approx(report["model_flops_per_step"], rel=0.15)


@needs_cuda_compiler
def test_xla_routing_compiles_no_triton_kernel(h100_compiles):
    """The same step with impl=xla: no Pallas kernel, so the marker above really marks the kernel."""
    report, triton_calls, _, _ = h100_compiles["xla"]
    assert triton_calls == 0 and report["pallas_kernel_calls"] == 0 and report["routing_impl"] == "xla"
    assert report["fits"] is True and report["per_device_bytes"] > 0


@needs_cuda_compiler
def test_two_phase_routing_compiles_its_k_query_kernels_for_the_h100(h100_compiles):
    """impl=pallas with group_layers=2: phase one of two-phase routing is the K-query Triton kernel
    (kernels_pallas/depth_route/pallas_gpu.py prefix_*, forward and backward) in the H100 train step."""
    report, triton_calls, prefix_calls, _ = h100_compiles["two_phase"]
    assert prefix_calls >= 2 and report["pallas_kernel_calls"] == triton_calls >= prefix_calls
    assert report["routing_impl"] == "pallas" and report["fits"] is True


@needs_cuda_compiler
def test_auto_routes_with_the_triton_kernel_on_a_gpu(h100_compiles):
    """impl=auto on a GPU: each sublayer's routing is the Triton kernel (phase one of two-phase routing stays
    in XLA: tests/test_depth_route_kernel.py); in bf16 the "auto" attention is cuDNN's fused attention,
    compiled here without a GPU (the target config states cuDNN's version)."""
    report, triton_calls, prefix_calls, cudnn_calls = h100_compiles["auto_bf16"]
    assert triton_calls >= 2 and prefix_calls == 0
    assert cudnn_calls >= 2  # forward and backward
    assert h100_compiles["xla"][3] == 0  # float32: the xla attention


@needs_cuda_compiler
def test_gpu_estimate_reads_every_kernel_of_the_step(h100_compiles):
    """The GPU step-time model (deltares/training/gpu_step_time.py) of the compiled step: its matrix-product
    FLOPs, read from the HLO with the layer loop counted by its trip count, agree with the traced step's
    (counted from the jaxpr); the routed step launches routing kernels, and the fused kernel fewer of them."""
    for label in ("xla", "pallas", "auto_bf16"):
        report = h100_compiles[label][0]
        e = report["estimate"]
        assert e["flops"] == pytest.approx(report["flops_per_step"], rel=0.1), label  # cuDNN attention in both
        assert e["seconds"] == pytest.approx(sum(row["seconds"] for row in e["by_kind"].values()))
        assert e["kernels"] == sum(row["kernels"] for row in e["by_kind"].values()) > 0
        assert e["routing_kernels"] > 0 and e["kernels_per_sublayer"] == e["kernels"] / (2 * report["n_layers"])
        assert e["seconds"] > e["launch_seconds"] >= 0 and 0 < e["mfu"] < 1
    xla, pallas = h100_compiles["xla"][0]["estimate"], h100_compiles["pallas"][0]["estimate"]
    assert pallas["by_kind"]["Pallas kernels (Triton)"]["kernels"] >= 2 and "Pallas kernels (Triton)" not in xla["by_kind"]
    assert pallas["routing_kernels"] < xla["routing_kernels"]
    # cuDNN's causal attention, forward and backward (2.5 times the forward), in each of the 3 layers of
    # experiments/debug.py (4 heads of 16): 4 B H T T D / 2 a forward
    report = h100_compiles["auto_bf16"][0]
    B, T, H, D = report["global_batch"], report["seq_len"], 4, 16
    cudnn = report["estimate"]["by_kind"]["attention (cuDNN)"]
    assert cudnn["kernels"] == 2 * 3 and cudnn["flops"] == 3 * 3.5 * 4 * B * H * T * T * D / 2


@needs_cuda_compiler
def test_the_reported_flops_count_cudnn_attention(h100_compiles):
    """The report's FLOPs per step (counted from the traced step) hold cuDNN's fused attention as its kernels
    compute it: in the layer scan of experiments/debug.py (3 layers, 4 heads of 16) one causal forward call,
    4 B H T T D / 2, and one backward, 2.5 times that, each counted once per layer. Against the same step with
    the xla attention (float32, the same routing kernel), whose products are 12 B H T T D a layer (two of
    2 B H T T D forward, twice those backward), the count differs by exactly 3 x (3.5 x 2 - 12) B H T T D."""
    report = h100_compiles["auto_bf16"][0]
    B, T, H, D, L = report["global_batch"], report["seq_len"], 4, 16, report["n_layers"]
    forward = 4 * B * H * T * T * D / 2
    assert report["traced_attention"] == [["dot_product_attention_fwd_wrapper", forward],
                                          ["dot_product_attention_bwd_wrapper", 2.5 * forward]]
    assert h100_compiles["pallas"][0]["traced_attention"] == []
    assert report["routing_impl"] == "auto" and h100_compiles["pallas"][0]["routing_impl"] == "pallas"
    assert report["flops_per_step"] - h100_compiles["pallas"][0]["flops_per_step"] == L * (3.5 * 2 - 12) * B * H * T * T * D
    assert report["estimate"]["by_kind"]["attention (cuDNN)"]["flops"] == L * 3.5 * forward  # the compiled calls


@needs_cuda_compiler
def test_gpu_estimate_of_a_routed_mode_states_its_ratio_and_band(h100_compiles):
    """A routed mode's estimate compiles baseline's step too: the ratio of the two estimates, and the band the
    model's error on the cost over baseline (gpu_step_time.CALIBRATION.overhead_error) puts on it."""
    from deltares.training.gpu_step_time import CALIBRATION

    report = h100_compiles["xla"][0]
    e = report["estimate"]
    v = e["vs_baseline"]
    assert 0 < v["baseline_seconds"] < e["seconds"] and v["ratio"] == pytest.approx(e["seconds"] / v["baseline_seconds"])
    overhead = e["seconds"] - v["baseline_seconds"]
    lo, hi = CALIBRATION.overhead_error
    assert (v["low"], v["high"]) == pytest.approx((1 + overhead / (1 + hi) / v["baseline_seconds"],
                                                   1 + overhead / (1 + lo) / v["baseline_seconds"]))
    assert e["calibration"]["overhead_error"] == [lo, hi]
    assert f"estimated vs baseline: {v['ratio']:.3f}x" in aot.format_report(report)
    assert "vs_baseline" not in h100_compiles["pallas"][0]["estimate"]  # not asked for


@needs_cuda_compiler
def test_two_h100s_hold_half_the_state_each(h100_compiles):
    """--gpu h100:2: the step compiled for 2 GPUs, sharded over the experiment's mesh (FSDP over all devices).
    Each device holds half the train state: against the parameters counted from the abstract state (float32
    parameters and AdamW's two moments, 12 bytes a parameter) and against the one-GPU compile of the same
    step; the compiled program gathers parameters and reduces gradients across the GPUs."""
    one, two = h100_compiles["xla"][0], h100_compiles["fsdp2"][0]
    assert two["devices"] == 2 and two["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1} and two["gpu"] == "h100"
    assert two["params"] == one["params"] and two["global_batch"] == one["global_batch"] == 4
    batch_bytes = 4 * (32 + 1) * 4  # int32 tokens of the global batch
    assert one["argument_bytes"] == pytest.approx(12 * one["params"] + batch_bytes, rel=0.01)
    assert two["argument_bytes"] == pytest.approx(one["argument_bytes"] / 2, rel=0.02)
    assert one["hlo_collectives"] == {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
    assert two["hlo_collectives"]["all-gather"] > 0
    assert two["hlo_collectives"]["reduce-scatter"] + two["hlo_collectives"]["all-reduce"] > 0
    assert two["flops_per_step"] == pytest.approx(one["flops_per_step"]) and two["fits"] is True
    assert two["flops_per_device"] == pytest.approx(one["flops_per_step"] / 2)
    assert "estimate" not in two
    assert "gpu h100: 2 x NVIDIA H100 80GB HBM3, mesh data=1 fsdp=2 tensor=1" in aot.format_report(two)


@needs_cuda_compiler
def test_command_line_report_for_one_h200():
    proc = run_module("deltares.aot", "--config", "experiments/debug.py:baseline", "--gpu", "h200", "--estimate",
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "estimated step time:" in out and "per step on one H200 (a model of the GPU's kernels" in out
    assert "kernel launches per step" in out and "matrix products" in out and "estimated MFU:" in out
    assert "gpu h200: 1 x NVIDIA H200 141GB HBM3e, mesh data=1 fsdp=1 tensor=1" in out
    assert "of 141.00 GiB HBM (the device memory of deltares/training/gpu_targets/)" in out
    for word in ("arguments", "outputs", "temporaries", "total", "FLOPs per step", "fits: yes"):
        assert word in out, word
    assert "Traceback" not in proc.stderr


@needs_cuda_compiler
def test_plugin_kept_apart_is_registered_after_jax_started():
    """A program that has started JAX (its CPU backend) before asking for GPU devices: JAX discovered
    its plugins then, without the folder; gpu_devices registers the plugin itself."""
    code = """if True:
        import jax, jax.numpy as jnp
        print(float(jnp.ones(3).sum()))  # backends started: plugins discovered
        from deltares.training import gpu_aot
        (device,) = gpu_aot.gpu_devices("h200")
        mesh = jax.sharding.Mesh([device], ("x",))
        arg = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
        compiled = jax.jit(lambda a: (a @ a).sum()).lower(arg).compile()
        print(device.device_kind, device.platform, compiled.memory_analysis().argument_size_in_bytes)
    """
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["3.0", f"NVIDIA H200 141GB HBM3e gpu {256 * 256 * 4}"], proc.stdout


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--gpu", "h300:8"), "choose one of h100, h200"),
        (("--gpu", "h100:2", "--estimate"), "models no traffic between GPUs"),
        (("--gpu", "h100", "--topology", "v5e:2x2"), "exclude each other"),
    ],
)
def test_bad_gpu_is_one_error_line(flags, words):
    proc = run_module("deltares.aot", "--config", "experiments/debug.py", *flags, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], proc.stderr


def test_gpu_count_is_parsed_and_bad_forms_are_refused():
    assert gpu_aot.parse_gpu("h100") == ("h100", 1) and gpu_aot.parse_gpu(" H200:8 ") == ("h200", 8)
    for bad in ("h100:", "h100:0", "h100:-1", "h100:x", "h100:2:2", "h100:1.5", "h100:nan", "h100:99999999999"):
        with pytest.raises(ValueError, match="NAME:N with N a number of GPUs of one node from 1 to 256"):
            gpu_aot.parse_gpu(bad)
    with pytest.raises(ValueError, match="choose one of h100, h200"):
        gpu_aot.parse_gpu("a100:8")


def test_unknown_gpu_name_is_a_value_error():
    with pytest.raises(ValueError, match="h100, h200"):
        gpu_aot.gpu_devices("a100")


def test_missing_compiler_says_what_to_install(tmp_path):
    """Without the plugin (an empty folder, nothing beside jax) the error names the pip command."""
    if any(_has_plugin(p) for p in sys.path if os.path.realpath(p) != os.path.realpath(gpu_aot.compiler_dir())):
        pytest.skip("the CUDA plugin is installed beside jax here")
    env = {**ENV, gpu_aot.COMPILER_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "deltares.aot", "--config", "experiments/debug.py", "--gpu", "h100",
                           "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    import jax

    assert f'pip install "jax[cuda12]=={jax.__version__}"' in error
    assert "JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1" in error
    assert not [line for line in proc.stdout.splitlines() if line.startswith("{")]


def test_target_configs_ship_and_state_the_memory():
    assert gpu_aot.device_memory_bytes("h100") == 84942979072
    assert gpu_aot.device_memory_bytes("H200") == 141 * 2**30
    for name in gpu_aot.GPUS:
        text = gpu_aot.target_config(name)
        assert 'platform_name: "CUDA"' in text and "major: 9" in text
    assert "4800000000000" in gpu_aot.target_config("h200") and "3352320000000" in gpu_aot.target_config("h100")


@needs_cuda_compiler
def test_splash_attention_for_a_gpu_is_one_error_line():
    """The TPU splash kernel cannot lower for a GPU: refused in one line before anything is compiled (it was
    a traceback of the Pallas lowering). The whole class, every platform, is walked in tests/test_attention.py."""
    proc = run_module("deltares.aot", "--config", "experiments/debug.py:delta_block", "--gpu", "h100",
                      "--config.model.attention=splash", "--config.data.seq_len=128", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: config: config.model.attention 'splash' runs on TPUs, these devices are gpu; use 'xla' "
                      "(or config.model.residual.interpret=True: the Pallas interpreter, slow) (the target: h100)"]


# ----------------------------------------------------------------------------- Mosaic GPU, and no system CUDA

# Runs in one subprocess (under `strace` with every system CUDA folder hidden, where the machine allows:
# `hidden_cuda`): the debug train step routed by the Mosaic GPU kernel, unrolled layers under remat `dots`
# (separate sources, cotangents accumulated in place) with the GPU estimate; the Mosaic GPU kernels alone
# on the scanned layers' stacked buffer (s1044m's width, bfloat16, a traced mask); a Triton kernel alone.
MOSAIC_COMPILES = """if True:
    import collections, importlib.machinery, json, re
    import jax, jax.numpy as jnp
    from deltares import aot
    from deltares.training import gpu_aot, gpu_step_time, hlo_kernels
    texts = []
    count = aot.pallas_kernel_calls
    aot.pallas_kernel_calls = lambda text: texts.append(text) or count(text)
    experiment = importlib.machinery.SourceFileLoader("debug", "experiments/debug.py").load_module()
    cfg = experiment.get_config("delta_block")
    cfg.model.residual.impl, cfg.model.scan_layers, cfg.model.remat = "pallas_mosaic_gpu", False, "dots"
    report = aot.analyze(cfg, None, config_name="experiments/debug.py:delta_block", gpu="h100", estimate=True,
                         vs_baseline=False)
    (hlo,) = texts  # the mode's step alone (no baseline compiled for a ratio)
    module = hlo_kernels.parse_module(hlo)
    calls, ranks, stacks = [], set(), 0
    B, T, D = report["global_batch"], report["seq_len"], cfg.model.d_model
    for name, instrs in module.computations.items():
        table = module.table(name)
        for ins in instrs:
            dims = hlo_kernels.dims_of(ins.type)
            if ins.opcode == "concatenate" and dims[-1:] == [D] and (dims[-3:-1] == [B, T] or dims[-2:-1] == [B * T]):
                stacks += 1  # sources stacked into one buffer
            if ins.opcode == "custom-call" and re.search(r'custom_call_target="mosaic_gpu(_v2)?"', ins.attrs):
                calls.append(ins)
                ranks |= {len(hlo_kernels.dims_of(table[o].type)) for o in ins.operands if o in table}
    kernels = gpu_step_time.program_kernels(hlo)
    backends = collections.Counter(k.own for k in kernels)
    mosaic = [k for k in kernels if k.own == "Mosaic GPU"]
    out = dict(report=report, calls=len(calls), aliased=sum("output_to_operand_aliasing" in c.attrs for c in calls),
               operand_ranks=sorted(ranks), stacks=stacks,
               backends={str(k): v for k, v in backends.items()},
               routing=all(gpu_step_time.is_routing(k) for k in mosaic))
    from kernels_pallas.depth_route import pallas_gpu, pallas_mosaic_gpu
    mesh = jax.sharding.Mesh(gpu_aot.gpu_devices("h100"), ("x",))
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    S, N, D = 5, 256, 1280
    args = (sds((S, N, D), jnp.bfloat16), sds((S,), jnp.int32), sds((D,), jnp.float32), sds((N, D), jnp.bfloat16))
    for name, module in (("mosaic_stacked", pallas_mosaic_gpu), ("triton", pallas_gpu)):
        def fwd_bwd(src, valid, q, dout, module=module):
            o, lse = module.forward(src, valid, None, q, None, eps=1e-6)
            return o, module.backward(src, valid, None, q, lse, dout, eps=1e-6)
        with jax.set_mesh(mesh):  # the kernels' target: the mesh's GPUs (jax 0.12's Triton lowering asks)
            text = jax.jit(fwd_bwd).lower(*args).compile().as_text()
        out[name] = dict(mosaic=len(re.findall(r'custom_call_target="mosaic_gpu(_v2)?"', text)),
                         triton=text.count('custom_call_target="__gpu$xla.gpu.triton"'))
    print("RESULT " + json.dumps(out), flush=True)
"""
CUDA_TOOLS = ("nvcc", "ptxas", "nvlink", "fatbinary", "nvdisasm", "cuobjdump", "cudafe++", "bin2c", "cu++filt",
              "__nvcc_device_query")
CUDA_FILE = re.compile(r"(^|/)(lib(cuda|cudart|nvrtc|nvJitLink|nvvm|nvptxcompiler|cublas|cudnn)[^/]*|libdevice[^/]*|"
                       + "|".join(re.escape(t) for t in CUDA_TOOLS) + r")$")


def system_cuda(folder: str) -> tuple[list[str], list[str]]:
    """(folders, files) of the CUDA this machine has outside the compiler's folder: the usual install
    folders, and every CUDA tool on PATH (a wrapper script, a link) with the folder it resolves into."""
    dirs = [d for d in glob.glob("/usr/local/cuda*") + ["/usr/lib/cuda", "/opt/nvidia", "/usr/lib/nvidia-cuda-toolkit"]
            if os.path.isdir(d) and not os.path.islink(d)]
    files = []
    for tool in CUDA_TOOLS:
        for entry in os.environ.get("PATH", "").split(os.pathsep):
            path = os.path.join(entry, tool)
            if os.path.isfile(path) and not path.startswith(folder):
                files.append(path)
                real = os.path.dirname(os.path.dirname(os.path.realpath(path)))  # <toolkit>/bin/ptxas -> <toolkit>
                if real not in ("/", "/usr", "/usr/local") and os.path.isdir(real) and real not in dirs:
                    dirs.append(real)
    return dirs, sorted(set(files))


def _can_hide() -> str | None:
    """Why this machine cannot hide its CUDA from a process (None: it can)."""
    if os.geteuid() != 0:
        return "hiding the system CUDA needs root (a private mount namespace)"
    for tool in ("unshare", "strace"):
        if not shutil.which(tool):
            return f"{tool} is not installed (.ci/run installs it)"
    return None


@pytest.fixture(scope="module")
def mosaic_compiles(tmp_path_factory):
    """(results of MOSAIC_COMPILES, the strace log or None, the hidden folders and files) for the compiler
    folder `gpu_aot.compiler_dir()`; hidden and traced where `_can_hide()` allows."""
    folder = os.path.realpath(gpu_aot.compiler_dir())
    command = [sys.executable, "-c", MOSAIC_COMPILES]
    trace, dirs, files = None, [], []
    if _can_hide() is None and _has_plugin(folder):
        dirs, files = system_cuda(folder)
        trace = str(tmp_path_factory.mktemp("strace") / "trace.log")
        mounts = [f"mount -t tmpfs none '{d}'" for d in dirs] + [f"mount --bind /dev/null '{f}'" for f in files]
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   " && ".join(mounts + ['exec "$@"']), "sh",
                   "strace", "-f", "-qq", "-e", "trace=open,openat,execve", "-o", trace, *command]
    proc = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), trace, dirs, files, folder


@needs_cuda_compiler
def test_mosaic_gpu_kernel_compiles_into_the_h100_step_with_separate_sources(mosaic_compiles):
    """impl=pallas_mosaic_gpu, unrolled layers under remat `dots`: the kernels of
    kernels_pallas/depth_route/pallas_mosaic_gpu.py, forward and backward, are in the H100 train step
    (compiled for sm_90a), every operand a separate [tokens, D] source (no [S, N, D] buffer, no
    concatenation of the sources), the backward accumulating cotangents in place (aliased operands);
    the GPU estimate reads them as Mosaic GPU kernels of the routing. The stacked layout's kernels
    compile at s1044m's width, and a Triton kernel beside them."""
    out = mosaic_compiles[0]
    report = out["report"]
    assert report["routing_impl"] == "pallas_mosaic_gpu" and report["fits"] is True
    assert out["calls"] >= 2 * 2 * report["n_layers"]  # forward and backward of each sublayer's router
    assert report["pallas_kernel_calls"] == out["calls"] and out["backends"].get("Mosaic GPU") == out["calls"]
    assert "Triton" not in out["backends"] and out["routing"] is True
    assert out["aliased"] >= 1  # the cotangents of passed sources, added into in place
    assert out["operand_ranks"] == [1, 2] and out["stacks"] == 0
    assert report["estimate"]["routing_kernels"] >= out["calls"]
    assert out["mosaic_stacked"] == {"mosaic": 2, "triton": 0} and out["triton"] == {"mosaic": 0, "triton": 2}


@needs_cuda_compiler
def test_gpu_compiles_read_nothing_of_a_system_cuda(mosaic_compiles):
    """The compiles above ran with every system CUDA folder (and every CUDA tool on PATH) hidden in a private
    mount namespace, under strace: the compiler folder's ptxas ran and its libdevice was read; no file of a
    CUDA outside the folder was opened or run, and no program but python and the folder's ran."""
    reason = _can_hide()
    if reason is not None and not os.environ.get("CI"):  # in CI it must run: fail, not skip
        pytest.skip(reason)
    _, trace, dirs, files, folder = mosaic_compiles
    assert trace is not None, reason or f"the CUDA compiler is not kept in a folder of its own ({folder})"
    opened, ran = set(), set()
    for line in open(trace, encoding="utf-8", errors="replace"):
        m = re.match(r'\d+\s+(open|openat|execve)\((?:AT_FDCWD, )?"([^"]+)".*\) = (\d+)', line)
        if m:
            (ran if m.group(1) == "execve" else opened).add(os.path.normpath(m.group(2)))
    inside = lambda p: os.path.realpath(p).startswith(folder + os.sep)  # noqa: E731
    assert any(p.endswith("/bin/ptxas") and inside(p) for p in ran), sorted(ran)
    assert any(p.endswith("/nvvm/libdevice/libdevice.10.bc") and inside(p) for p in opened)
    hidden = [p for p in opened | ran if any(p == d or p.startswith(d + os.sep) for d in dirs) or p in files]
    assert not hidden, hidden
    assert not [p for p in opened | ran if CUDA_FILE.search(p) and not inside(p)]
    python = {os.path.realpath(sys.executable)}
    assert not [p for p in ran if not inside(p) and os.path.realpath(p) not in python], sorted(ran)


def test_cuda_compiler_requirements_bring_ptxas_libdevice_and_mosaic_gpu():
    """requirements-cuda-compiler(-py312).txt: the plugin and its Mosaic GPU companion of the jax version the
    environment pins, and CUDA's compiler wheel of the CUDA version the plugin was built with (12)."""
    for name, pins in (("requirements-cuda-compiler.txt", "requirements.txt"),
                       ("requirements-cuda-compiler-py312.txt", "requirements-py312.txt")):
        wanted = dict(re.findall(r"^([\w.-]+)==(\S+)", open(os.path.join(ROOT, name)).read(), re.M))
        jax_version = dict(re.findall(r"^([\w.-]+)==(\S+)", open(os.path.join(ROOT, pins)).read(), re.M))["jax"]
        assert wanted["jax-cuda12-pjrt"] == wanted["jax-cuda12-plugin"] == jax_version, name
        assert wanted["nvidia-cuda-nvcc-cu12"].startswith("12."), name


def test_gpu_aot_points_the_compilers_at_the_folder(tmp_path, monkeypatch):
    """`use_cuda_toolkit`: a folder holding nvidia-cuda-nvcc-cu12's ptxas and libdevice becomes jax's CUDA path
    (XLA's xla_gpu_cuda_data_dir), Mosaic GPU's CUDA root and the front of PATH; a folder without them is
    left alone."""
    from jax._src import lib

    toolkit = tmp_path / "nvidia" / "cuda_nvcc"
    for part in (("bin", "ptxas"), ("nvvm", "libdevice", "libdevice.10.bc")):
        (toolkit.joinpath(*part[:-1])).mkdir(parents=True, exist_ok=True)
        toolkit.joinpath(*part).write_bytes(b"")
    monkeypatch.setattr(lib, "cuda_path", None)
    mosaic = sys.modules.get("jax.experimental.mosaic.gpu.core")  # imported by another test: its default restored
    if mosaic is not None:
        monkeypatch.setattr(mosaic, "cuda_root", mosaic.cuda_root)
    for key in ("PATH", "MOSAIC_GPU_CUDA_ROOT", "CUDA_ROOT"):
        monkeypatch.setenv(key, "/usr/bin" if key == "PATH" else "unset")
    assert not gpu_aot.use_cuda_toolkit(str(tmp_path / "empty")) and lib.cuda_path is None
    assert gpu_aot.use_cuda_toolkit(str(tmp_path))
    assert lib.cuda_path == str(toolkit) == os.environ["MOSAIC_GPU_CUDA_ROOT"] == os.environ["CUDA_ROOT"]
    assert os.environ["PATH"].split(os.pathsep)[:2] == [str(toolkit / "bin"), "/usr/bin"]
