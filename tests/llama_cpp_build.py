"""libllama built from the llama.cpp tree that the `llama-cpp-python` source package vendors, for the slow GGUF
test (tests/test_gguf_llama_cpp.py). CPU only and only the `llama` library target (no tools, examples, tests
or server), in a folder keyed by the package's version so one build serves every later run.

    K3_LLAMA_CPP_SDIST   the llama_cpp_python-<version>.tar.gz to build from (default: the first
                         llama_cpp_python-*.tar.gz in /tmp/llsrc)
    K3_LLAMA_CPP_BUILD   where builds are kept (default: /tmp/llama-build)

Run as a program it builds (or finds) the library and prints its path.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

DEFAULT_SDIST_DIR = Path("/tmp/llsrc")
DEFAULT_BUILD_ROOT = Path("/tmp/llama-build")
# a plain shared library: the ggml CPU backend linked in, no OpenMP (a second copy of the runtime beside
# torch's in one process is asking for trouble), no HTTPS client or anything else the library does not need
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
]


class LlamaCppUnavailable(RuntimeError):
    """No source package to build from (the slow test skips, naming what to provide)."""


def find_sdist() -> Path:
    given = os.environ.get("K3_LLAMA_CPP_SDIST")
    if given:
        path = Path(given)
        if not path.is_file():
            raise LlamaCppUnavailable(f"K3_LLAMA_CPP_SDIST={given} is not a file")
        return path
    found = sorted(DEFAULT_SDIST_DIR.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise LlamaCppUnavailable(
            f"no llama_cpp_python-*.tar.gz in {DEFAULT_SDIST_DIR}: `pip download --no-deps --no-binary :all: "
            f"llama-cpp-python` there, or set K3_LLAMA_CPP_SDIST"
        )
    return found[-1]


def sdist_version(sdist: Path) -> str:
    m = re.fullmatch(r"llama_cpp_python-(.+)\.tar\.gz", sdist.name)
    if not m:
        raise LlamaCppUnavailable(f"{sdist.name} is not named llama_cpp_python-<version>.tar.gz")
    return m[1]


def build_libllama(sdist: Path | None = None, jobs: int = 2) -> tuple[Path, Path, float]:
    """(libllama.so, the llama.cpp source tree, seconds spent building; 0 when the cached build was used)."""
    sdist = sdist or find_sdist()
    root = Path(os.environ.get("K3_LLAMA_CPP_BUILD", DEFAULT_BUILD_ROOT)) / f"llama-cpp-python-{sdist_version(sdist)}"
    src = root / "src" / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    build = root / "build"
    done = root / "built.ok"
    lib = build / "bin" / "libllama.so"
    if done.exists() and lib.exists():
        return lib, src, 0.0
    start = time.perf_counter()
    if not src.is_dir():
        shutil.rmtree(root / "src", ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(root / "src", filter="data")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS], check=True)
    subprocess.run([*nice, "cmake", "--build", str(build), "--target", "llama", "-j", str(jobs)], check=True)
    if not lib.exists():
        raise RuntimeError(f"the build finished but {lib} is missing")
    done.write_text(str(sdist) + "\n")
    return lib, src, time.perf_counter() - start


def build_probe(lib: Path, src: Path) -> Path:
    """tests/llama_cpp_probe.cpp compiled against the library (kept beside it, keyed by the program's text)."""
    program = Path(__file__).with_name("llama_cpp_probe.cpp")
    digest = hashlib.sha256(program.read_bytes()).hexdigest()[:12]
    exe = lib.parent / f"k3-llama-probe-{digest}"
    if not exe.exists():
        include = [f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}"]
        link = [f"-L{lib.parent}", "-lllama", f"-Wl,-rpath,{lib.parent}"]
        tmp = exe.with_suffix(".tmp")
        subprocess.run(["g++", "-std=c++17", "-O1", *include, str(program), "-o", str(tmp), *link], check=True)
        tmp.replace(exe)
    return exe


if __name__ == "__main__":
    lib, src, seconds = build_libllama()
    how = f"built in {seconds:.0f} s" if seconds else "cached"
    print(f"{lib} ({how}; source {src})", file=sys.stdout)
