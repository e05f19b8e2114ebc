# Source on a GPU machine that has PyTorch but no CUDA toolkit: puts the CUDA runtime libraries
# that PyTorch's wheels install (cudart, cublas, cublasLt, curand, nvrtc) on LD_LIBRARY_PATH so a
# layertap binary built with `--features cuda` elsewhere can start. The driver's libcuda.so.1
# comes from the system.
_nv_root=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0] + "/"))')
_nv_libs=$(find "$_nv_root" -maxdepth 3 -type d -name lib | tr '\n' ':')
export LD_LIBRARY_PATH="${_nv_libs}${LD_LIBRARY_PATH:-}"
unset _nv_root _nv_libs
