"""Channels-last convolutions (setting `channels_last`): CPU graphs, and GPU graphs in half precision.

oneDNN, which runs ATen's CPU convolutions, is fastest on channels-last ([N, H, W, C]) tensors: given
[N, C, H, W] ones it converts them on every call. So are cuDNN's tensor-core kernels for bfloat16 and
float16 on a GPU, around which cuDNN transposes [N, C, H, W] operands on every call. As Inductor's
layout optimization does, an inference graph's 2-d convolutions read channels-last inputs:

    clone(x, memory_format=channels_last)   before each convolution whose input is not in that layout
                                            already, and before its weight on a GPU (where autocast's
                                            cast of the weight writes its copy in that layout) and under
                                            `freezing` (where the prologue converts it once; without it
                                            oneDNN converts it per call either way)
    re-propagation                          every value downstream takes its new strides (FX meta `val`,
                                            computed by the graph's fake mode as eager would lay it out):
                                            a convolution's result is channels-last, and so are the
                                            pointwise ops reading it, which ember's kernels then write in
                                            that layout (aten/importer.py: a permuted layout is kept)
    dropped clones                          a clone of a value that is channels-last already (the next
                                            convolution reading a ReLU of the last one) goes; only the
                                            graph's first input, and values made in another layout, are
                                            converted

Only a value's layout changes, never its elements (up to the rounding of oneDNN's channels-last kernel,
another order of the same sums), so eager's results hold wherever strides are not observed. Where
they are, the old layout comes back first (`clone(..., contiguous_format)`, shared by every such reader): the graph's outputs (their strides are what the caller sees), ops outside ATen (a
custom op may assume a contiguous input) and higher-order ops, mutating ops, random ops (which draw in
memory order) and views whose strides no longer allow them (`view` of a channels-last tensor as
[N, C*H*W]). A graph that reads a changed value's strides or storage (`as_strided`, `sym_stride`), or
returns a view of one (AOTAutograd may rebuild it from its base's strides), or whose old layout is not
row-major where it must come back, is left as it was.

When: inference graphs with a 2-d convolution of static sizes (not transposed), on the CPU or in half
precision on a GPU, unless the weights to convert per call outnumber the convolutions' inputs
(`_not_worth_it`: ResNet-18 on the CPU, not MobileNetV2, nor a GPU graph whose weights only autocast's
casts feed). With symbolic sizes the importer keeps computed values row-major, so each convolution's
result would be converted back before the kernels that read it; such graphs are left as they are.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from ember import log

aten = torch.ops.aten

# Ops whose result depends on its input's strides or storage, not only on its elements: a graph that
# applies one to a value whose layout changed is left as it was.
_READS_STRIDES = {
    aten.as_strided,
    aten.as_strided_copy,
    aten.as_strided_scatter,
    aten._reshape_alias,
    aten.sym_stride,
    aten.sym_storage_offset,
    aten.is_contiguous,
    aten.is_non_overlapping_and_dense,
    aten.set_,
}
# Views that raise where the new strides do not allow them: their input gets its old layout back.
_VIEWS_NEEDING_STRIDES = {aten.view, aten._unsafe_view, aten.view_copy}
# Half-precision dtypes, whose GPU convolutions run channels-last.
_HALF = (torch.float16, torch.bfloat16)
# Dtype conversions as AOTAutograd's graphs spell them.
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


class _Declined(Exception):
    """The graph is left as it was (the reason is logged)."""


def to_channels_last(gm: fx.GraphModule, convert_weights: bool, weights_packed: bool = False) -> int:
    """Rewrite an inference graph (in place) so that its 2-d convolutions read channels-last inputs, and
    weights too where `convert_weights`; returns how many convolutions now do (0: the graph is as it was).
    `weights_packed`: freezing will pack the weights for oneDNN once (frontend/prepack.py), so no weight
    is converted per call whatever its layout."""
    convs = [n for n in gm.graph.nodes if _convertible(n)]
    if not convs:
        return 0
    reason = None if weights_packed else _not_worth_it(convs, convert_weights)
    if reason is not None:
        log.artifact("graph", "channels-last", lambda: f"not applied: {reason}")
        return 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake_mode is None:
        return 0
    rewrite = _Rewrite(gm.graph, fake_mode)
    try:
        for conv in convs:
            rewrite.convert_operand(conv, 0)
            if convert_weights:
                rewrite.convert_operand(conv, 1)
        rewrite.propagate()
    except _Declined as e:
        rewrite.undo()
        reason = str(e)
        log.artifact("graph", "channels-last", lambda: f"not applied: {reason}")
        return 0
    except BaseException:
        rewrite.undo()  # the caller compiles the graph as it was
        raise
    gm.recompile()
    converted = sum(1 for n in convs if _is_channels_last(n.args[0].meta["val"]))
    log.artifact(
        "graph",
        "channels-last",
        lambda: (
            f"{converted} of {len(convs)} convolutions read channels-last inputs; "
            f"{rewrite.kept_clones} conversion(s) to channels-last, {rewrite.restores} back"
        ),
    )
    return converted


def _convertible(node: fx.Node) -> bool:
    """A 2-d convolution (not transposed) of static sizes in floating point, on the CPU, or on a GPU in
    half precision (cuDNN's tensor-core kernels read [N, H, W, C]: given [N, C, H, W] tensors they
    transpose them on every call)."""
    if node.op != "call_function" or node.target is not aten.convolution.default or node.args[6]:
        return False
    x, w = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
    return all(
        isinstance(t, torch.Tensor)
        and t.dim() == 4
        and (t.device.type == "cpu" or (t.device.type == "cuda" and t.dtype in _HALF))
        and t.is_floating_point()
        and not free_symbols(t)
        for t in (x, w)
    )


def _not_worth_it(convs: list[fx.Node], convert_weights: bool) -> str | None:
    """Why channels-last would slow the graph down, or None.

    A weight that is not channels-last is converted on every call: by oneDNN, fed a channels-last input
    (a k x k kernel over several input channels; 1x1 and depthwise kernels are in both layouts), or by
    the graph's own clone where `convert_weights`. Measured on the 2-core CPU machine at batch 1, 224²,
    per convolution (channels-last time / row-major time): depthwise 0.5-0.8, 1x1 0.6-0.85, k x k 0.9-1.0
    with a channels-last weight, but 1.1 with a row-major one, and up to 5x on ResNet-18's 512-channel 3x3
    convolutions, whose weights outweigh their 7x7 inputs. So the graph stays as it is where the weights
    to convert hold more elements than the convolutions' inputs: ResNet-18 (11M against 2M: 35 ms per
    call became 58; 34 ms either way where freezing converted the weights once, at the cost of a second
    copy of them), not MobileNetV2 or EfficientNet-B0 (only the 3-channel stem's 864).

    A weight the graph casts (autocast's copy of a float32 weight into bfloat16) costs nothing more where
    the graph converts it: the cast's kernel writes its copy channels-last."""
    converted = sum(
        n.args[1].meta["val"].numel()
        for n in convs
        if not _is_channels_last(n.args[1].meta["val"]) and not (convert_weights and _cast(n.args[1], convs))
    )
    inputs = sum(n.args[0].meta["val"].numel() for n in convs)
    if converted > inputs:
        return (
            f"{converted} weight elements would be converted to channels-last, more than the {inputs} input "
            "elements of the convolutions"
        )
    return None


def _cast(value, convs: list[fx.Node]) -> bool:
    """A dtype conversion on one device that only the convolutions converted read, each as its weight: a
    kernel ember writes, in the layout those readers take."""
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target in _CASTS):
        return False
    source, result = value.args[0], value.meta.get("val")
    return (
        isinstance(source, fx.Node)
        and isinstance(result, torch.Tensor)
        and source.meta.get("val") is not None
        and source.meta["val"].device == result.device
        and all(u in convs and u.args[1] is value and u.args[0] is not value for u in value.users)
    )


def _is_channels_last(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides along every dim longer than one: the same addresses for every element."""
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n != 1)


def _tensors(val) -> list:
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _strides_changed(old, new) -> bool:
    """Any stride at all: a graph output's strides are seen whole (a [N, C, 1, 1] result too)."""
    return any(
        isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o.stride() != n.stride()
        for o, n in zip(_tensors(old), _tensors(new))
    )


class _Rewrite:
    """The clones inserted, the metas changed, and what undoes them."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph = graph
        self.fake_mode = fake_mode
        self.old_vals: dict[fx.Node, object] = {}  # node -> its meta val before the rewrite
        self.changed: set[fx.Node] = set()  # nodes whose layout differs from the old one
        # Nodes that read a changed value and kept their old meta strides. Some ATen ops' fake kernels
        # say row-major where the real one keeps a channels-last input's layout (roll, channel_shuffle,
        # max_unpool2d): ember runs them as ATen calls, so the meta cannot be trusted for what they return.
        self.touched: set[fx.Node] = set()
        self.inserted: list[fx.Node] = []
        self.to_channels_last: dict[fx.Node, fx.Node] = {}  # value -> its channels-last clone
        self.restored: dict[fx.Node, fx.Node] = {}  # changed value -> its clone in the old layout
        self.kept_clones = 0
        self.restores = 0

    # -- edits -------------------------------------------------------------------------------
    def _clone(self, before: fx.Node, value: fx.Node, memory_format: torch.memory_format) -> fx.Node:
        with self.graph.inserting_before(before):
            clone = self.graph.call_function(aten.clone.default, (value,), {"memory_format": memory_format})
        clone.meta["val"] = self._run(clone)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in before.meta:
                clone.meta[key] = before.meta[key]
        self.inserted.append(clone)
        return clone

    def convert_operand(self, conv: fx.Node, index: int) -> None:
        """Let `conv` read its operand `index` through a channels-last clone (one per value)."""
        value = conv.args[index]
        if not isinstance(value, fx.Node) or _is_channels_last(value.meta["val"]):
            return
        clone = self.to_channels_last.get(value)
        if clone is None:  # (convolutions come in graph order: the first reader makes the clone)
            clone = self._clone(conv, value, torch.channels_last)
            self.to_channels_last[value] = clone
        conv.replace_input_with(value, clone)
        self._record(conv)

    def _record(self, node: fx.Node) -> None:
        self.old_vals.setdefault(node, node.meta.get("val"))

    def undo(self) -> None:
        """Put the graph back as it was: the clones out, every meta val back."""
        for clone in reversed(self.inserted):
            if clone.graph is self.graph and clone in self.graph.nodes:
                clone.replace_all_uses_with(clone.args[0])
                self.graph.erase_node(clone)
        for node, val in self.old_vals.items():
            node.meta["val"] = val

    # -- propagation -------------------------------------------------------------------------
    def _run(self, node: fx.Node):
        """`node`'s value as eager would compute it from its operands' metas (the graph's fake mode)."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            return node.target(*args, **kwargs)

    def propagate(self) -> None:
        """Walk the graph in order: each node reading a changed value gets its new meta; a clone to
        channels-last of a value that is in that layout already goes; where strides are observed, the
        old layout comes back."""
        inserted = set(self.inserted)
        for node in list(self.graph.nodes):
            if node in inserted:
                self._settle_clone(node)
                continue
            if node.op == "output":
                self._restore_outputs(node)
                continue
            if not any(a in self.changed for a in node.all_input_nodes):
                continue
            if self._observes_layout(node):
                self._restore_all(node)
            else:
                self._repropagate(node)

    def _settle_clone(self, clone: fx.Node) -> None:
        source = clone.args[0]
        if clone.kwargs["memory_format"] is torch.channels_last and _is_channels_last(source.meta["val"]):
            for user in list(clone.users):
                self._record(user)
            clone.replace_all_uses_with(source)
            self.graph.erase_node(clone)
            self.inserted.remove(clone)
            self.to_channels_last.pop(source, None)
            return
        clone.meta["val"] = self._run(clone)
        self.changed.add(clone)
        self.kept_clones += 1

    def _observes_layout(self, node: fx.Node) -> bool:
        target = node.target
        if node.op != "call_function":
            return True
        if target is operator.getitem:
            return False
        if not isinstance(target, torch._ops.OpOverload):
            return True  # a higher-order op, a Python function
        if target.overloadpacket in _READS_STRIDES:
            raise _Declined(f"{node.name} ({target}) reads the strides of a value whose layout changed")
        if target.namespace not in ("aten", "prims"):
            return True  # a custom op: it may assume its inputs' layout
        schema = target._schema
        return (
            schema.is_mutable
            or torch.Tag.nondeterministic_seeded in target.tags
            or torch.Tag.dynamic_output_shape in target.tags
            or torch.Tag.data_dependent_output in target.tags
        )

    def _repropagate(self, node: fx.Node) -> None:
        self._record(node)
        if node.target is operator.getitem:
            new = node.args[0].meta["val"][node.args[1]]
        else:
            try:
                new = self._run(node)
            except Exception as e:  # noqa: BLE001 - any failure of the op on the new layout
                if node.target.overloadpacket in _VIEWS_NEEDING_STRIDES and self._restore_all(node):
                    self._repropagate(node)  # on the old layouts: its own old strides (a size-1 dim's too)
                    return
                raise _Declined(f"{node.name} ({node.target}) fails on the new layout: {e}") from None
        old = node.meta.get("val")
        if _strides_changed(old, new):
            node.meta["val"] = new
            self.changed.add(node)
        else:
            self.touched.add(node)

    def _restore_all(self, reader: fx.Node) -> bool:
        changed = [a for a in reader.all_input_nodes if a in self.changed]
        for a in changed:
            self._restore(reader, a)
        return bool(changed)

    def _restore(self, reader: fx.Node, value: fx.Node, exact: bool = False) -> fx.Node:
        """Let `reader` read `value` in its old layout, through one clone per value."""
        old = self.old_vals.get(value)
        if not isinstance(old, torch.Tensor) or not old.is_contiguous():
            raise _Declined(f"{value.name} must keep its old layout, which is not row-major, for {reader.name}")
        clone = self.restored.get(value)
        if clone is None:
            clone = self._clone(reader, value, torch.contiguous_format)
            self.restored[value] = clone
            self.restores += 1
        new = clone.meta["val"]
        if not _same_layout(new, old) or (exact and new.stride() != old.stride()):
            raise _Declined(
                f"{value.name}: strides {tuple(old.stride())} cannot be restored (a copy has {new.stride()})"
            )
        self._record(reader)
        reader.replace_input_with(value, clone)
        return clone

    def _restore_outputs(self, output: fx.Node) -> None:
        """The graph's outputs keep the strides eager gives them, exactly: the caller sees them. An
        output computed from a changed value whose meta kept its old row-major strides is copied to
        them too (a kernel computing it writes the copy directly; an ATen call's result may not be in
        the layout its meta says)."""
        for value in output.all_input_nodes:
            if value in self.touched and value not in self.changed:
                old = self.old_vals.get(value)
                if isinstance(old, torch.Tensor) and old.is_contiguous():
                    self._restore(output, value, exact=True)
                continue
            if value not in self.changed:
                continue
            producer = value.args[0] if value.target is operator.getitem else value
            schema = getattr(producer.target, "_schema", None)
            if schema is not None and any(r.alias_info for r in schema.returns):
                raise _Declined(f"output {value.name} is a view of a value whose layout changed")
            self._restore(output, value, exact=True)
