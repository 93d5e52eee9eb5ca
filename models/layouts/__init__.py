"""Layouts: which device holds each KV group and each FFN neuron, per layer; how they are named and
resolved. One module per concept, each importing only those above it in this list:

    names.py      the grammar of layout names and the seeds of random layouts (dependency-free)
    layout.py     `Layout`: balance, checks, contiguous and random layouts, JSON
    resolve.py    a layout name turned into a `Layout` for one run (files of an optimise output)

The file format's name and `LayoutError` (`models.base.layout_format`) and `ModelShape`
(`models.base.shapes`) stand on the ground floor; the layouts a run builds and scores are
`models.variants`. Import the submodule that defines a name: importing this package loads nothing.
"""
