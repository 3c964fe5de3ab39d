"""Ships ``terascale-standin.pth`` into site-packages beside the package, in a wheel and in an
editable install alike ([Note: the stand-in switch] in terascale/integrations/deepspeed/standin.py).
Everything else about the build is in pyproject.toml."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "terascale-standin.pth"


class BuildPy(build_py):
    """A wheel's root is site-packages: the .pth goes there."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: int = 1) -> list:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheel(editable_wheel):
    """An editable wheel is written from its unpacked folder, whose namespace step is the one
    hook setuptools has into that folder: the .pth joins it there."""

    def _install_namespaces(self, installation_dir, pth_prefix):  # noqa: ANN001
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
