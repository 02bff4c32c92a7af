#!/usr/bin/python3
"""Writes the small ONNX models the tests read (committed beside them), with Debian's python3-onnx
(onnx.helper only: no PyTorch needed). Run from the repository root:

    /usr/bin/python3 tools/make_test_onnx.py src/tessel/planner/testdata

gpt_block.onnx: one pre-norm GPT-2 block with fused QKV, 4 heads of 8 (C = 32, 4C MLP with
GELU as erf), on a [batch, 16, 32] input whose batch dimension is symbolic ("batch"): the graph planner
must shard it like Megatron (column-parallel QKV and fc, row-parallel projections). Weights are
drawn from a fixed seed; their values do not matter to the planner, only their shapes.
"""
import pathlib
import random
import sys

import onnx
from onnx import TensorProto, helper

C, H, T, F = 32, 4, 16, 128
D = C // H


def weight(name, *dims):
    rnd = random.Random(name)
    n = 1
    for d in dims:
        n *= d
    return helper.make_tensor(name, TensorProto.FLOAT, dims, [rnd.uniform(-0.1, 0.1) for _ in range(n)])


def ints(name, values):
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def gpt_block():
    inits = [weight("ln1.w", C), weight("ln1.b", C), weight("attn.qkv.w", C, 3 * C),
             weight("attn.qkv.b", 3 * C), weight("attn.proj.w", C, C), weight("attn.proj.b", C),
             weight("ln2.w", C), weight("ln2.b", C), weight("mlp.fc.w", C, F), weight("mlp.fc.b", F),
             weight("mlp.proj.w", F, C), weight("mlp.proj.b", C),
             ints("heads_shape", [0, T, H, D]), ints("merge_shape", [0, T, C]),
             ints("split_sizes", [C, C, C]),
             helper.make_tensor("scale", TensorProto.FLOAT, [], [D ** -0.5]),
             helper.make_tensor("sqrt2", TensorProto.FLOAT, [], [2 ** 0.5]),
             helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1.w", "ln1.b"], ["ln1"], name="ln1", axis=-1),
        n("MatMul", ["ln1", "attn.qkv.w"], ["qkv_mm"], name="attn.qkv"),
        n("Add", ["qkv_mm", "attn.qkv.b"], ["qkv"], name="attn.qkv.bias"),
        n("Split", ["qkv", "split_sizes"], ["q", "k", "v"], name="split_qkv", axis=-1),
        n("Reshape", ["q", "heads_shape"], ["qh"], name="q_heads"),
        n("Reshape", ["k", "heads_shape"], ["kh"], name="k_heads"),
        n("Reshape", ["v", "heads_shape"], ["vh"], name="v_heads"),
        n("Transpose", ["qh"], ["qt"], name="q_t", perm=[0, 2, 1, 3]),
        n("Transpose", ["kh"], ["kt"], name="k_t", perm=[0, 2, 3, 1]),
        n("Transpose", ["vh"], ["vt"], name="v_t", perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["scores_raw"], name="qk"),
        n("Mul", ["scores_raw", "scale"], ["scores"], name="scale_scores"),
        n("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        n("MatMul", ["probs", "vt"], ["ctx"], name="pv"),
        n("Transpose", ["ctx"], ["ctx_t"], name="ctx_t", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_t", "merge_shape"], ["ctx_m"], name="merge_heads"),
        n("MatMul", ["ctx_m", "attn.proj.w"], ["proj_mm"], name="attn.proj"),
        n("Add", ["proj_mm", "attn.proj.b"], ["proj"], name="attn.proj.bias"),
        n("Add", ["x", "proj"], ["res1"], name="residual1"),
        n("LayerNormalization", ["res1", "ln2.w", "ln2.b"], ["ln2"], name="ln2", axis=-1),
        n("MatMul", ["ln2", "mlp.fc.w"], ["fc_mm"], name="mlp.fc"),
        n("Add", ["fc_mm", "mlp.fc.b"], ["fc"], name="mlp.fc.bias"),
        # GELU as opset 17 exporters write it: x * 0.5 * (1 + erf(x / sqrt(2))).
        n("Div", ["fc", "sqrt2"], ["fc_s"], name="gelu.div"),
        n("Erf", ["fc_s"], ["fc_e"], name="gelu.erf"),
        n("Add", ["fc_e", "one"], ["fc_e1"], name="gelu.add"),
        n("Mul", ["fc", "fc_e1"], ["fc_m"], name="gelu.mul"),
        n("Mul", ["fc_m", "half"], ["act"], name="gelu.half"),
        n("MatMul", ["act", "mlp.proj.w"], ["mproj_mm"], name="mlp.proj"),
        n("Add", ["mproj_mm", "mlp.proj.b"], ["mproj"], name="mlp.proj.bias"),
        n("Add", ["res1", "mproj"], ["y"], name="residual2"),
    ]
    graph = helper.make_graph(
        nodes, "gpt_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", T, C])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", T, C])], inits)
    model = helper.make_model(graph, producer_name="tessel tools/make_test_onnx.py",
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src/tessel/planner/testdata")
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(gpt_block(), out / "gpt_block.onnx")
    print(f"wrote {out / 'gpt_block.onnx'}")


if __name__ == "__main__":
    main()
