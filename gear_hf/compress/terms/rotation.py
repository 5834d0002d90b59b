"""The rotation term: an orthonormal Walsh–Hadamard rotation along head_dim before compressing, undone at
reconstruction (`gear_hf.compress.rotation`). It stores nothing."""

from __future__ import annotations

from ..rotation import rotate
from .base import DecodeState, EncodeState, Term


class Rotation(Term):
    name = "rotation"
    builtin = True

    def active(self, spec) -> bool:
        return spec.rotate

    def transforms(self, spec) -> bool:
        return spec.rotate

    def transform(self, st: EncodeState) -> None:
        # float32 when rotated, else the model's own values
        st.work = rotate(st.x) if st.spec.rotate else st.x

    def untransform(self, ds: DecodeState) -> None:
        if ds.spec.rotate:
            ds.x = rotate(ds.x)  # H is its own inverse
