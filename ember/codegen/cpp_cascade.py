"""Which floating sums a C++ kernel adds in cascaded blocks (codegen/cpp.py's CppRenderer mixes this in).

A long row summed into one accumulator loses precision as the sum grows; ember's C++ kernels sum such rows
in blocks whose sums are added pairwise (`ember_cascade` in the kernel prelude). The rows this applies to:
floating sums over more than `cpp.cascade_min_row` elements, and over shorter ones whose innermost loads
stride (the compiler may keep such a loop scalar, adding the elements one after another).
"""

from __future__ import annotations

import sympy

from ember.ir.sizes import product
from ember.schedule.kernel import KLoad, KReduce


class CascadedSums:
    """The cascade decisions of a C++ renderer: it provides `h` (CppHeuristics), `_dims`, `nodes`, `kernel`,
    `column_tiled` and `_acc_names`."""

    def _cascaded(self, r: KReduce) -> bool:
        """Whether r sums its row in blocks whose sums are added pairwise (`_cascade_block` elements)."""
        if self._long_row(r):
            return True
        if r.kind != "sum" or not r.dtype.is_floating_point or not self._strided_reduce():
            return False
        row = product(s for _, s in self._dims(reduce=True))
        return not (row.is_Integer and int(row) <= self.h.strided_cascade_block)

    def _long_row(self, r: KReduce) -> bool:
        """Whether r is a floating sum over more than cpp.cascade_min_row elements (or a row known only at
        run time): cascaded whatever its loads."""
        if r.kind != "sum" or not r.dtype.is_floating_point:
            return False  # integer sums are exact, max and min do not round
        row = product(s for _, s in self._dims(reduce=True))
        return not (row.is_Integer and int(row) <= self.h.cascade_min_row)

    @property
    def _cascade_block(self) -> int:
        return self.h.strided_cascade_block if self._strided_reduce() else self.h.cascade_block

    def _strided_reduce(self) -> bool:
        """Whether a load along the innermost reduce loop steps by other than one element (or through a
        gathered position): the compiler may keep such a loop scalar (GCC does on AVX2 CPUs), adding
        the row's elements one after another rather than across vector lanes."""
        if not hasattr(self, "_strided_memo"):
            dims = self._dims(reduce=True)
            v = dims[-1][0] if dims else None
            self._strided_memo = False
            for n in self.nodes if v is not None else ():
                if isinstance(n, KLoad):
                    expr = self.kernel.index(n.index)
                    if v in expr.free_symbols and (n.rows or sympy.diff(expr, v) != 1):
                        self._strided_memo = True
                        break
            # Column tiles sum a tile's columns across vector lanes, each over the rows (cpp_columns.py).
            self._strided_memo = self._strided_memo and not self.column_tiled()
        return self._strided_memo

    def _cascade_name(self, r: KReduce) -> str:
        return self._acc_names[id(r)].removesuffix("_block") + "_sums"
