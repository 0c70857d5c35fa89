"""Host cost of one Triton launch, by path: what does each way of launching cost the CPU?

The GPU is kept busy (torch.cuda._sleep) while N launches are issued, so the host-side time of
the loop is the launch path's own cost, not the GPU's. Paths: `kernel[grid](...)`, Triton's
compiled launcher (`CompiledKernel.run`, ember's direct launch) with tensors or with integer
addresses, torch's static CUDA launcher (what Inductor uses) with tensors or integers, and for
scale torch.empty_strided and Tensor.data_ptr.

    python scripts/gpu_launcher_probe.py --out launcher.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import triton
import triton.language as tl


@triton.jit
def add4(a, b, c, out, n, XBLOCK: tl.constexpr):
    x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    m = x < n
    tl.store(out + x, tl.load(a + x, m) + tl.load(b + x, m) * tl.load(c + x, m), m)


def host_us(fn, launches: int = 400, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda._sleep(50_000_000)  # the GPU is busy: launches only queue
        t = time.perf_counter()
        for _ in range(launches):
            fn()
        best = min(best, (time.perf_counter() - t) / launches * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="launcher.json")
    args = p.parse_args()
    n = 4096
    a, b, c, out = (torch.randn(n, device="cuda") for _ in range(4))
    ref = a + b * c
    compiled = add4.warmup(torch.float32, torch.float32, torch.float32, torch.float32, n, grid=(1,), XBLOCK=1024)
    compiled._init_handles()
    stream = torch.cuda.current_stream().cuda_stream
    grid = (n // 1024,)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    meta = compiled.packed_metadata
    fn = compiled.function
    run = compiled.run
    res["grid_us"] = host_us(lambda: add4[grid](a, b, c, out, n, XBLOCK=1024))
    res["compiled_run_tensors_us"] = host_us(
        lambda: run(grid[0], 1, 1, stream, fn, meta, None, None, None, a, b, c, out, n, 1024)
    )
    pa, pb, pc, po = a.data_ptr(), b.data_ptr(), c.data_ptr(), out.data_ptr()
    res["compiled_run_ints_us"] = host_us(
        lambda: run(grid[0], 1, 1, stream, fn, meta, None, None, None, pa, pb, pc, po, n, 1024)
    )
    out.zero_()
    run(
        grid[0],
        1,
        1,
        stream,
        fn,
        meta,
        None,
        None,
        None,
        a.data_ptr(),
        b.data_ptr(),
        c.data_ptr(),
        out.data_ptr(),
        n,
        1024,
    )
    torch.cuda.synchronize()
    res["compiled_run_ints_correct"] = bool(torch.allclose(out, ref))
    res["signature"] = {str(k): str(v) for k, v in compiled.src.signature.items()}
    md = compiled.metadata
    res["metadata"] = {
        k: str(getattr(md, k, None))
        for k in (
            "name",
            "shared",
            "num_warps",
            "num_ctas",
            "global_scratch_size",
            "profile_scratch_size",
            "launch_pdl",
            "launch_cooperative_grid",
        )
    }
    try:
        from torch._C import _StaticCudaLauncher as S

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            loaded = S._load_kernel(path, md.name, md.shared, torch.cuda.current_device())
        res["static_load_result_len"] = len(loaded)
        func = loaded[1] if len(loaded) == 4 else loaded[0]
        extra = ""
        extra_args: tuple = ()
        for field in ("global_scratch_size", "profile_scratch_size"):
            if hasattr(md, field):
                extra += "O"
                extra_args += (None,)
        tys = "OOOOi" + extra
        nw = md.num_warps
        sh = md.shared
        out.zero_()
        S._launch_kernel(func, grid[0], 1, 1, nw, sh, tys, (a, b, c, out, n, *extra_args), stream)
        torch.cuda.synchronize()
        res["static_tensors_correct"] = bool(torch.allclose(out, ref))
        launch = S._launch_kernel
        res["static_tensors_us"] = host_us(
            lambda: launch(func, grid[0], 1, 1, nw, sh, tys, (a, b, c, out, n, *extra_args), stream)
        )
        res["static_ints_us"] = host_us(
            lambda: launch(func, grid[0], 1, 1, nw, sh, tys, (pa, pb, pc, po, n, *extra_args), stream)
        )
        res["static_ints_dataptr_us"] = host_us(
            lambda: launch(
                func,
                grid[0],
                1,
                1,
                nw,
                sh,
                tys,
                (a.data_ptr(), b.data_ptr(), c.data_ptr(), out.data_ptr(), n, *extra_args),
                stream,
            )
        )
    except Exception as e:  # noqa: BLE001 - reported in the results, not hidden
        res["static_error"] = f"{type(e).__name__}: {e}"
    res["empty_strided_us"] = host_us(
        lambda: torch.empty_strided((64, 64), (64, 1), dtype=torch.float32, device="cuda")
    )
    res["data_ptr_x4_us"] = host_us(lambda: (a.data_ptr(), b.data_ptr(), c.data_ptr(), out.data_ptr()))
    res["torch_add_us"] = host_us(lambda: torch.add(a, b, out=out))
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
