"""SPMD rules: for an op and its inputs' layouts, the candidate strategies (pure metadata).

Importing this package registers every rule family. Users add rules for their own ops with
``register_rule`` (whole mesh) or ``register_axis_rule`` (one mesh axis; the registry takes the
product over axes).
"""


from spmd_rules import (  # noqa: F401  (importing a family registers its rules)
    conv_attention,
    losses,
    matmul,
    nn,
    optim_ops,
    pointwise,
    random_ops,
    reduction,
    shape_ops,
    tensor_ops,
    view,
)
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, ScalarMeta, Strategy, TensorMeta
from spmd_rules.registry import (
    get_local_impl,
    get_rule,
    has_rule,
    register_axis_rule,
    register_local_impl,
    register_rule,
)

__all__ = [
    "AxisStrategy",
    "LocalContext",
    "OpCall",
    "ScalarMeta",
    "Strategy",
    "TensorMeta",
    "get_local_impl",
    "get_rule",
    "has_rule",
    "register_axis_rule",
    "register_local_impl",
    "register_rule",
]
