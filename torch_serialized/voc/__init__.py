"""Pascal VOC on both sides of a pack: VOCdevkit discovery, XML -> torchvision's target, pack,
append, the VOC meaning checked at open, export. Each module's docstring says its part. Import the
submodules directly; nothing is re-exported here, so importing one does not pull in the others."""
