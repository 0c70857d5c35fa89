"""Where hf_bert's attention goes under torch.compile: the mask Dynamo hands SDPA (shape, strides), the
attention ops AOTAutograd traces, and SDPA's time with and without a mask.

    PYTHONPATH=$PWD python3 scripts/gpu_bert_sdpa_probe.py
"""

import collections
import time

import torch
import transformers

from ember.frontend.backend import register
from ember.tools.bench import workloads as W

print("transformers", transformers.__version__, "torch", torch.__version__)
built = W._hf_bert((32, 512, 2), "cuda")
m, (ids,) = built.fn, built.inputs
seen = []


def spy(gm, ex):
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot" in str(n.target):
            metas = [
                (
                    a.meta.get("example_value").shape,
                    a.meta.get("example_value").dtype,
                    a.meta.get("example_value").stride(),
                )
                if isinstance(a, torch.fx.Node) and a.meta.get("example_value") is not None
                else a
                for a in list(n.args) + list(n.kwargs.values())
            ]
            seen.append((str(n.target), metas, dict(n.kwargs)))
    return gm.forward


torch._dynamo.reset()
with torch.no_grad():
    torch.compile(m, backend=spy)(ids)
for s in seen[:2]:
    print("dynamo SDPA:", s)
from torch._functorch.aot_autograd import aot_module_simplified


def aot_spy(gm, ex):
    def fw(g, e):
        c = collections.Counter(str(n.target) for n in g.graph.nodes if n.op == "call_function")
        print(
            "AOT forward ops:",
            {
                k: v
                for k, v in c.items()
                if any(w in k for w in ("attention", "softmax", "bmm", "mm", "expand", "where"))
            },
        )
        return g.forward

    return aot_module_simplified(gm, ex, fw_compiler=fw)


torch._dynamo.reset()
with torch.no_grad():
    torch.compile(m, backend=aot_spy)(ids)


# eager: which SDPA kernel and how fast, with the compiled-path mask vs none
def bench(f, n=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


q = torch.randn(32, 12, 512, 64, device="cuda", dtype=torch.bfloat16)
mask = torch.zeros(32, 1, 1, 512, device="cuda", dtype=torch.bfloat16).expand(32, 1, 512, 512)
F = torch.nn.functional
with torch.no_grad():
    print("sdpa no mask ms", bench(lambda: F.scaled_dot_product_attention(q, q, q)))
    print("sdpa expanded mask ms", bench(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask)))
    for name, f in [("eager", m), ("ember", torch.compile(m, backend=register())), ("inductor", torch.compile(m))]:
        torch._dynamo.reset()
        print(name, "model ms", bench(lambda f=f: f(ids), 10))
