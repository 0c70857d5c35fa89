"""The import floor: an ATen FX graph (from AOTAutograd) -> ember's Graph, op by op through the lowerings."""
