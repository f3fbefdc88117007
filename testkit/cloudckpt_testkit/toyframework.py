"""A framework plug-in for the activation tests (``cloudckpt.frameworks`` entry point
``toyfw``): binds a saver of cloudckpt's into :mod:`cloudckpt_testkit.toytrainer`."""

from __future__ import annotations

from types import ModuleType

from cloudckpt.core.plugins import Binding, Framework

MODULE = "cloudckpt_testkit.toytrainer"

FRAMEWORK = Framework(
    name="toyfw",
    bindings=(Binding(module=MODULE, bind="cloudckpt_testkit.toyframework:bind",
                      fingerprint=("Saver.save", "train")),),
    # No distribution: identified by its code, as a source tree is.
    tested=("sha256:0217b65fbdd81306",),
)


def bind(module: ModuleType) -> tuple[str, ...]:
    own = module.Saver

    class BoundSaver(own):  # type: ignore[misc, valid-type]
        by = "cloudckpt"

        def save(self, data: bytes) -> str:
            from cloudckpt.storage import open_store

            open_store(self.path).put("state", data)
            return self.path

    module.Saver = BoundSaver
    return ("Saver",)
