"""What a backward raises when gradients arrive where the step cannot take them."""

from __future__ import annotations

import warnings


class LateGradientError(RuntimeError):
    """A parameter's gradient arrived after its unit had finished its backward and reduced.

    What it means: the parameter was used outside the forward of the module that owns it (read from
    another module's forward), so its gradient reached the engine
    after its unit's gradients had been reduced across the ranks. Rather than lose it, the backward
    raises, naming the parameter and its unit.

    What to do: call the owning module instead of reading its parameter elsewhere, or choose a wrap
    policy (``wrap_policy=``, Accelerate's ``wrap_classes``) whose unit contains every module that uses
    the parameter; shared parameters are owned by the lowest unit containing all their users.
    """

    @classmethod
    def for_parameter(cls, name: str, unit_label: str) -> LateGradientError:
        return cls(
            f"The gradient of '{name}' arrived after {unit_label} "
            "had finished its backward and reduced its gradients: the parameter is used outside the "
            "forward of the module that owns it. Call the owning module instead of reading its "
            "parameter elsewhere, or choose a wrap policy whose unit contains every module that uses it."
        )


class UnscaledBackwardError(RuntimeError):
    """fp16: gradients arrived from a backward the loss scaler did not scale.

    What it means: with fp16 mixed precision the loss is multiplied by the loss scale before backward
    and the step divides the gradients by it; a plain ``loss.backward()`` skips the multiplication, so
    its gradients would be divided by the loss scale when the step unscales them. The backward is
    refused instead.

    What to do: call the engine's backward instead of ``loss.backward()``: ``engine.backward(loss)``,
    ``accelerator.backward(loss)``, ``fabric.backward(loss)``, or Lightning's own backward (return the
    loss from ``training_step``). Or train in bf16, which needs no loss scaling.
    """

    @classmethod
    def plain_backward(cls) -> UnscaledBackwardError:
        return cls(
            "fp16 training needs loss scaling, but this backward did not come from engine.backward(loss) "
            "(or accelerator.backward / fabric.backward / Lightning's own backward), so its gradients "
            "would be divided by the loss scale when the step unscales them. Call the engine's backward "
            "instead of loss.backward()."
        )


def warn_accumulation_dropped() -> None:
    warnings.warn(
        "A backward raised during gradient accumulation in ZeRO stage 1, where gradients "
        "accumulate in place: the micro-batches accumulated since the last optimizer step were "
        "discarded with it. The next step uses only the micro-batches that follow.",
        RuntimeWarning,
        stacklevel=5,
    )
