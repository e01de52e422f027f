"""Pascal VOC on both sides of a pack.

Source side, in the order a pack is made: ``layout`` (find a VOCdevkit, read its ImageSets),
``xml`` (annotation XML -> torchvision's exact target), ``classes``, ``schema`` (what a packed
VOC record holds, and its codecs), ``source`` (plan the ids, load one id), ``images``
(pack-time image work), ``records`` (write records: shared by both writers), ``pack``
(``pack_voc``), ``changes`` and ``append`` (``append_voc``). Reading side: ``checks`` (the
VOC meaning of a pack, checked once at open), ``packed`` (``VOCPackReader``), ``names`` and
``export`` (``export_voc``). Import the submodules directly; nothing is re-exported here, so
importing one does not pull in the others.
"""
