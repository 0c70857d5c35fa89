"""Column sums on the C++ target, a tile of columns at a time (CppHeuristics.column_tile).

A sum over the rows of columns contiguous in memory (a bias gradient: [tokens, features] summed over
the tokens; a norm weight's, with a per-token scale) loops down each column in the renderer's usual
form: one strided reduction per column, about 2.5 GB/s for BERT's [128, 1024] bias gradient on the
2-core machine. Here the kernel runs `column_tile` columns at a time instead: each tile's
accumulators start at zero, every row adds into them in a vector loop along the columns (values
stored at every row and column are stored in that loop too), then the tile's results are finalized
and stored. Each column's rows are added one after another (the row loop's `omp simd reduction`
added them in vector lanes: a sum's rounding differs by the order).
"""

from __future__ import annotations

import sympy

from ember.codegen.render import print_index
from ember.ir.sizes import product
from ember.schedule.kernel import KConst, KConvert, KIndex, KLoad, KNode, KReduce, subtree


class ColumnTiles:
    """Mixed into the C++ renderer (codegen/cpp.py: CppRenderer), whose emission, loop dims and
    reduction hooks it uses: `_dims`, `direct_reduce`, `_long_row`, `_zero`, `ctype` and `h` (its
    CppHeuristics)."""

    def column_tiled(self) -> bool:
        """Whether the kernel is rendered in column tiles: one outer dim (the columns) of at least two
        tiles (so that two threads share them), one loop over the rows, plain floating sums short
        enough to need no cascade, nothing stored before them but what is stored at every row and
        column, per-column values in the sums that are only loads (computed again for every row of a
        tile), and every load that walks the rows either contiguous along the columns and strided
        along the rows, or one value per row (a row's scale), at least one the former."""
        k = self.kernel
        outer, rows = self._dims(reduce=False), self._dims(reduce=True)
        if self.h.column_tile <= 1 or len(outer) != 1 or not rows or k.num_phases != 1:
            return False
        columns = outer[0][1]
        if not columns.is_Integer or int(columns) < 2 * self.h.column_tile:
            return False
        if any(r.kind != "sum" or not r.dtype.is_floating_point or r.online_max is not None for r in k.reduces):
            return False
        if any(self.direct_reduce(r) or self._long_row(r) or _costly_per_column(r.arg) for r in k.reduces):
            return False
        if any(s.phase == 0 and not s.full for s in k.stores):
            return False
        column, row = outer[0][0], rows[-1][0]
        strided = 0
        for load in (n for n in self.nodes if isinstance(n, KLoad) and n.full):
            index = k.index(load.index)
            if index.has(sympy.Function):  # floor divisions, remainders: no fixed step along either
                return False
            index = sympy.expand(index)
            along_columns, along_rows = index.coeff(column), index.coeff(row)
            if along_columns == 1 and along_rows.is_Integer and abs(int(along_rows)) > 1:
                strided += 1
            elif not (along_columns == 0 and along_rows != 0):
                return False
        return strided > 0

    def render_column_tiles(self) -> None:
        """The loops of a kernel `column_tiled` accepts (inside its function's braces)."""
        k = self.kernel
        (column, size), rows = self._dims(reduce=False)[0], self._dims(reduce=True)
        tile, n = self.h.column_tile, print_index(size, "/")
        total = product(k.loop_sizes)
        if not (total.is_Integer and int(total) <= self.h.parallel_threshold):  # as render's outer loops
            self.emit(f"#pragma omp parallel for if(parallel: {print_index(total, '/')} > {self.h.parallel_threshold})")
        self.emit(f"for (int64_t {column.name}_tile = 0; {column.name}_tile < {n}; {column.name}_tile += {tile}) {{")
        self.indent += 1
        end = f"{column.name}_end"
        self.emit(f"const int64_t {end} = std::min<int64_t>({column.name}_tile + {tile}, {n});")
        lane = f"{column.name} - {column.name}_tile"
        accs = {id(r): self.fresh("acc") for r in k.reduces}
        for r in k.reduces:
            self.emit(f"{self.ctype(r.dtype)} {accs[id(r)]}[{tile}];")
        self._open_columns(column, end)
        for r in k.reduces:
            self.emit(f"{accs[id(r)]}[{lane}] = {self._zero(r)};")
        self._close()
        for v, s in rows:
            self.emit(f"for (int64_t {v.name} = 0; {v.name} < {print_index(s, '/')}; {v.name}++) {{")
            self.indent += 1
        self._open_columns(column, end)
        saved = dict(self.names)
        for r in k.reduces:
            self.emit_node(r.arg)
            self.emit(f"{accs[id(r)]}[{lane}] += {self.ref(r.arg)};")
        for store in (s for s in k.stores if s.full):
            self.emit_node(store.value)
            self.emit_store(store)
        self.names = saved
        self._close()
        for _ in rows:
            self._close()
        self._open_columns(column, end)
        for r in k.reduces:
            name = self.fresh("red")
            self.names[id(r)] = name
            self.emit(f"{self.ctype(r.dtype)} {name} = {accs[id(r)]}[{lane}];")
        for node in self.nodes:
            if not node.full and not isinstance(node, KReduce) and node.ready == 1:
                self.emit_node(node)
        for store in (s for s in k.stores if not s.full):
            self.emit_node(store.value)
            self.emit_store(store)
        self._close()
        self._close()

    def _open_columns(self, column, end: str) -> None:
        """The vector loop over the tile's columns."""
        self.emit("#pragma omp simd")
        self.emit(f"for (int64_t {column.name} = {column.name}_tile; {column.name} < {end}; {column.name}++) {{")
        self.indent += 1

    def _close(self) -> None:
        self.indent -= 1
        self.emit("}")


def _costly_per_column(node: KNode) -> bool:
    """Whether a sum's argument holds a value that varies with the column only and is more than a
    load or a conversion of one (column tiles compute such values again for every row)."""
    return any(not n.full and not isinstance(n, (KLoad, KConst, KConvert, KIndex)) for n in subtree(node))
