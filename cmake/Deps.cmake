# Third-party dependencies.
#  - yaml-cpp, nlohmann-json, CLI11, GoogleTest: system packages
#  - LibTorch: the C++ library inside the torch wheel (VQAD_PYTHON's torch)
#  - Arrow/Parquet C++: the libraries inside the pyarrow wheel
set(VQAD_PYTHON "" CACHE FILEPATH "Python interpreter whose torch/pyarrow wheels provide LibTorch and Arrow")
if(NOT VQAD_PYTHON)
  if(DEFINED ENV{VQAD_PYTHON})
    set(VQAD_PYTHON "$ENV{VQAD_PYTHON}")
  else()
    find_program(VQAD_PYTHON NAMES python3 REQUIRED)
  endif()
endif()

function(_vqad_py out code)
  execute_process(COMMAND ${VQAD_PYTHON} -c "${code}" OUTPUT_VARIABLE _o
    RESULT_VARIABLE _rc ERROR_VARIABLE _e OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "vqad: '${VQAD_PYTHON} -c \"${code}\"' failed: ${_e}")
  endif()
  set(${out} "${_o}" PARENT_SCOPE)
endfunction()

# The wheels are located by path (importing torch from a --no-deps wheel without
# its CUDA packages may fail, and importing is not needed to link LibTorch).
_vqad_py(VQAD_SITE "import sysconfig; print(sysconfig.get_paths()['purelib'])")
set(VQAD_TORCH_ROOT "${VQAD_SITE}/torch" CACHE PATH "torch package directory")
set(VQAD_PYARROW_ROOT "${VQAD_SITE}/pyarrow" CACHE PATH "pyarrow package directory")
if(NOT EXISTS "${VQAD_TORCH_ROOT}/lib/libtorch_cpu.so")
  message(FATAL_ERROR "vqad: LibTorch not found at ${VQAD_TORCH_ROOT} (expected lib/libtorch_cpu.so); run scripts/bootstrap.sh or set VQAD_PYTHON")
endif()
if(NOT EXISTS "${VQAD_PYARROW_ROOT}/include/arrow/api.h")
  message(FATAL_ERROR "vqad: pyarrow C++ headers not found at ${VQAD_PYARROW_ROOT}/include; run scripts/bootstrap.sh or set VQAD_PYTHON")
endif()
message(STATUS "vqad: LibTorch from ${VQAD_TORCH_ROOT}")
message(STATUS "vqad: Arrow/Parquet from ${VQAD_PYARROW_ROOT}")

# --- LibTorch ---------------------------------------------------------------
add_library(vqad_torch INTERFACE)
add_library(vqad::torch ALIAS vqad_torch)
target_include_directories(vqad_torch SYSTEM INTERFACE
  "${VQAD_TORCH_ROOT}/include" "${VQAD_TORCH_ROOT}/include/torch/csrc/api/include")
set(_tl "${VQAD_TORCH_ROOT}/lib")
if(VQAD_TORCH_CUDA)
  # libtorch_cuda registers the CUDA backend from static initialisers: keep it
  # linked even though no symbol of it is referenced directly.
  target_link_libraries(vqad_torch INTERFACE
    "-Wl,--no-as-needed" "${_tl}/libtorch_cuda.so" "${_tl}/libc10_cuda.so" "-Wl,--as-needed"
    "${_tl}/libtorch_cpu.so" "${_tl}/libc10.so" CUDA::cudart)
  target_compile_definitions(vqad_torch INTERFACE VQAD_WITH_TORCH_CUDA=1 USE_C10D_NCCL)
else()
  target_link_libraries(vqad_torch INTERFACE "${_tl}/libtorch_cpu.so" "${_tl}/libc10.so")
endif()
target_link_options(vqad_torch INTERFACE "-Wl,-rpath,${_tl}")
find_package(Threads REQUIRED)
target_link_libraries(vqad_torch INTERFACE Threads::Threads)

# --- Arrow / Parquet (from pyarrow) ----------------------------------------------
file(GLOB _arrow_so "${VQAD_PYARROW_ROOT}/libarrow.so.*")
file(GLOB _parquet_so "${VQAD_PYARROW_ROOT}/libparquet.so.*")
list(FILTER _arrow_so EXCLUDE REGEX "\\.so\\.[0-9]+\\.[0-9]")
list(FILTER _parquet_so EXCLUDE REGEX "\\.so\\.[0-9]+\\.[0-9]")
if(NOT _arrow_so OR NOT _parquet_so)
  message(FATAL_ERROR "vqad: libarrow.so.* / libparquet.so.* not found in ${VQAD_PYARROW_ROOT}")
endif()
add_library(vqad_arrow INTERFACE)
add_library(vqad::arrow ALIAS vqad_arrow)
target_include_directories(vqad_arrow SYSTEM INTERFACE "${VQAD_PYARROW_ROOT}/include")
target_link_libraries(vqad_arrow INTERFACE ${_arrow_so} ${_parquet_so})
target_link_options(vqad_arrow INTERFACE "-Wl,-rpath,${VQAD_PYARROW_ROOT}")

# --- system packages ---------------------------------------------------------
find_package(yaml-cpp REQUIRED)
if(NOT TARGET yaml-cpp AND TARGET yaml-cpp::yaml-cpp)
  add_library(yaml-cpp ALIAS yaml-cpp::yaml-cpp)
endif()
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 QUIET CONFIG)
if(NOT TARGET CLI11::CLI11)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${CLI11_INCLUDE_DIR})
endif()
