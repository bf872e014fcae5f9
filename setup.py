"""The one compiled part: the A* search's state walk (hap/search/_core.cpp). Everything else,
and all metadata, is in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(ext_modules=[Pybind11Extension("hap.search._core", ["hap/search/_core.cpp"], cxx_std=17,
                                     extra_compile_args=["-O2"])])
