"""Pascal VOC source side: find a VOCdevkit, list its ids, parse its XML exactly as torchvision.

Import the submodules directly (``torch_serialized.voc.xml``, ``torch_serialized.voc.layout``);
nothing is re-exported here so that importing one does not pull in the others.
"""
