"""Predicting data-parallel scaling from a profile of a few ranks (``hpdl profile predict``).

The cost models come first, each module one concept: the fabrics' named figures with their
sources (presets), a network's levels parsed from the ``--network`` spec (network), measured
allreduce curves read from ``hpdl bench allreduce --json`` or OSU's ``osu_allreduce``
(curves), and the allreduce algorithms' costs over those levels (allreduce_cost). All are
pure: no state, no I/O beyond reading the files they are given. docs/predict.md has the
formulas and the sources.
"""
