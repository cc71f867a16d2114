"""The mesh's axis names: one place, for the modules that `layout` itself imports."""

STAGE, DATA, EXPERT, TENSOR = "stage", "data", "expert", "tensor"
INTRA = (EXPERT, TENSOR)  # the intra-node group as one axis
MESH_AXES = (STAGE, DATA, EXPERT, TENSOR)
ALL = (DATA, *INTRA)  # the devices of one pipeline stage
EVERY = (STAGE, *ALL)  # the whole mesh
