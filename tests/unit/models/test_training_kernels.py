"""fused_training_ops routes only the given model's own Qwen3 layers through liger, and undoes it.

The kernels themselves are Triton and run in tests/gpu against the module path;
here, on CPU, the patching: which modules it touches, that another model of
the same class is left alone, and that the class's forward shows through again.
"""

from __future__ import annotations

from miniverl.engine.models.training_kernels import fused_training_ops
from miniverl.engine.tiny.models import STUDENT_SPEC, build_model, load_tokenizer


def _patched(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def test_patches_each_layer_of_that_model_only_and_restores():
    tokenizer = load_tokenizer()
    model, other = build_model(STUDENT_SPEC, tokenizer, 1), build_model(STUDENT_SPEC, tokenizer, 2)
    layers = model.config.num_hidden_layers
    with fused_training_ops(model) as count:
        assert count == layers
        names = _patched(model)
        # four norms and the MLP a layer, and the final norm
        assert len(names) == 5 * layers + 1 and "model.norm" in names
        assert all(n.endswith(("layernorm", "q_norm", "k_norm", "mlp", "model.norm")) for n in names)
        assert _patched(other) == []
    assert _patched(model) == []
    with fused_training_ops(model, enabled=False) as count:
        assert count == 0 and _patched(model) == []
