"""Sizing policies: how a size shrinks after an out-of-memory error (`Halving`, `ShrinkByFactor`) and how it is
chosen from measurements (`FitToMemory`, with its model of the need and the bracket of the evidence)."""
