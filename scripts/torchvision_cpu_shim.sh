#!/usr/bin/env bash
# Makes PyPI's torchvision 0.28.0 import beside torch 2.13.0+cpu in VENV, for vLLM's Qwen-VL models on the CPU.
#
# PyPI's torchvision is a CUDA build: its _C.so links libc10_cuda.so and libtorch_cuda.so, which the CPU torch does not
# ship, so `import torchvision` fails ("operator torchvision::nms does not exist") and vLLM cannot import a Qwen-VL
# model (its module imports torchvision's transforms). The CPU paths never call CUDA, so two stand-in libraries that
# define the c10::cuda / at::cuda symbols _C.so needs (each aborts if it is ever called) let it load; a .pth file
# preloads them in every process of the venv. libcudart itself comes from the machine's CUDA toolkit (ldconfig).
# usage: scripts/torchvision_cpu_shim.sh VENV
set -euo pipefail
VENV=$1
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TORCH_LIBS=$SITE/torch/lib
SHIM=$SITE/torchvision_cpu_shim
mkdir -p "$SHIM"
# The symbols torchvision's _C.so needs that no torch library defines: the CUDA ones, to stand in for.
comm -23 <(nm -D --undefined-only "$SITE/torchvision/_C.so" | awk '{print $2}' | sort -u) \
         <(for lib in "$TORCH_LIBS"/*.so*; do nm -D --defined-only "$lib" 2>/dev/null | awk '{print $3}'; done | sort -u) \
    | grep -E '^_ZN2at4cuda|^_ZN3c104cuda|^_ZNK3c104cuda' >"$SHIM/symbols.txt"
{
    echo '#include <stdio.h>'
    echo '#include <stdlib.h>'
    echo 'static void refuse(const char *name) { fprintf(stderr, "torchvision called CUDA on a CPU build: %s\n", name); abort(); }'
    grep -v 'CUDACachingAllocator9allocatorE' "$SHIM/symbols.txt" | while read -r symbol; do
        echo "void f_$symbol(void) __asm__(\"$symbol\"); void f_$symbol(void) { refuse(\"$symbol\"); }"
    done
    if grep -q 'CUDACachingAllocator9allocatorE' "$SHIM/symbols.txt"; then
        echo 'void *cuda_allocator __asm__("_ZN3c104cuda20CUDACachingAllocator9allocatorE") = 0;'
    fi
} >"$SHIM/shim.c"
gcc -shared -fPIC -O1 -Wl,-soname,libc10_cuda.so -o "$SHIM/libc10_cuda.so" "$SHIM/shim.c"
gcc -shared -fPIC -Wl,-soname,libtorch_cuda.so -o "$SHIM/libtorch_cuda.so" -x c /dev/null
# (One line, no comprehension: site.py runs it with exec inside a function, where a comprehension cannot see `ctypes`.)
echo 'import ctypes, os; ctypes.CDLL(os.path.join(sitedir, "torchvision_cpu_shim", "libc10_cuda.so"), mode=ctypes.RTLD_GLOBAL); ctypes.CDLL(os.path.join(sitedir, "torchvision_cpu_shim", "libtorch_cuda.so"), mode=ctypes.RTLD_GLOBAL)' >"$SITE/zz_torchvision_cpu_shim.pth"
"$VENV/bin/python" -c 'import torchvision.ops, torch; assert torchvision.ops.nms(torch.tensor([[0., 0, 1, 1], [0, 0, 1, 1]]), torch.tensor([1., .5]), .5).tolist() == [0]'
echo "torchvision loads beside the CPU torch: $(wc -l <"$SHIM/symbols.txt") CUDA symbols stood in for"
