# The third-party libraries, as the imported targets the lutb targets link:
#   nlohmann_json::nlohmann_json  CLI11::CLI11  fmt::fmt  hwy::hwy  BLAS::BLAS (OpenBLAS)
#   GTest::gtest GTest::gtest_main (LUTB_TESTS)  benchmark::benchmark (LUTB_BENCH_CPU)
# Without LUTB_DEPS_DIR they are the Debian packages that scripts/setup.sh installs, found by
# find_package. With LUTB_DEPS_DIR they all come from that folder and from nowhere else (a machine
# that lacks the packages and has no network: the GPU machine), laid out as scripts/gpu_stage.sh
# fills it:
#   nlohmann_json/include  cli11/include  fmt/include   header-only (fmt with FMT_HEADER_ONLY)
#   hwy/include hwy/lib/libhwy.so.1                     Highway's headers and its library
#   openblas/include openblas/lib.tar.xz                cblas.h; libopenblas.so.0 and its Fortran
#                                                       runtime, unpacked into the build tree
#   googletest/                                         GoogleTest's sources (gtest, no gmock)
# OpenMP and Threads come with the compiler either way.

set(LUTB_DEPS_DIR "" CACHE PATH
    "Folder holding every third-party dependency (scripts/gpu_stage.sh fills it); empty: the system's packages")

find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)

if(NOT LUTB_DEPS_DIR)
  find_package(nlohmann_json 3.10 REQUIRED)
  find_package(CLI11 REQUIRED)
  find_package(fmt REQUIRED)
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS REQUIRED)
  find_package(hwy REQUIRED)
  if(LUTB_TESTS)
    find_package(GTest REQUIRED)
  endif()
  if(LUTB_BENCH AND LUTB_BENCH_CPU)
    find_package(benchmark REQUIRED)
  endif()
  return()
endif()

# lutb_dep_dir(<var> <name>): ${LUTB_DEPS_DIR}/<name>, which must exist.
function(lutb_dep_dir var name)
  set(dir "${LUTB_DEPS_DIR}/${name}")
  if(NOT IS_DIRECTORY "${dir}")
    message(FATAL_ERROR "LUTB_DEPS_DIR: ${dir} is missing (scripts/gpu_stage.sh fills it)")
  endif()
  message(STATUS "lutb: ${name} from ${dir}")
  set(${var} "${dir}" PARENT_SCOPE)
endfunction()

# Header-only libraries. Include folders of imported targets are system folders (-isystem): they
# come before /usr/include, and their headers' warnings are not ours.
lutb_dep_dir(dir nlohmann_json)
add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
set_target_properties(nlohmann_json::nlohmann_json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${dir}/include")

lutb_dep_dir(dir cli11)
add_library(CLI11::CLI11 INTERFACE IMPORTED)
set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${dir}/include")

# fmt's headers hold its whole implementation when FMT_HEADER_ONLY is defined.
lutb_dep_dir(dir fmt)
add_library(fmt::fmt INTERFACE IMPORTED)
set_target_properties(fmt::fmt PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${dir}/include"
  INTERFACE_COMPILE_DEFINITIONS "FMT_HEADER_ONLY=1")

# Highway: the headers and the shared library built from the same version (its dynamic dispatch
# lives in the library).
lutb_dep_dir(dir hwy)
add_library(hwy::hwy SHARED IMPORTED)
set_target_properties(hwy::hwy PROPERTIES
  IMPORTED_LOCATION "${dir}/lib/libhwy.so.1"
  INTERFACE_INCLUDE_DIRECTORIES "${dir}/include"
  INTERFACE_COMPILE_DEFINITIONS "HWY_SHARED_DEFINE")

# OpenBLAS: libopenblas.so.0 needs libgfortran.so.5, which needs libquadmath.so.0; the archive
# holds the three (xz: 36 MB of libraries in 4 MB of the carried tree). The executables get
# DT_RPATH rather than DT_RUNPATH: the loader searches a DT_RPATH for the dependencies of
# dependencies too, so the Fortran runtime is found beside libopenblas.so.0 where no system copy
# exists.
lutb_dep_dir(dir openblas)
set(LUTB_OPENBLAS_LIB_DIR "${CMAKE_BINARY_DIR}/_deps/openblas")
if(NOT EXISTS "${LUTB_OPENBLAS_LIB_DIR}/libopenblas.so.0"
   OR "${dir}/lib.tar.xz" IS_NEWER_THAN "${LUTB_OPENBLAS_LIB_DIR}/libopenblas.so.0")
  file(REMOVE_RECURSE "${LUTB_OPENBLAS_LIB_DIR}")
  file(ARCHIVE_EXTRACT INPUT "${dir}/lib.tar.xz" DESTINATION "${LUTB_OPENBLAS_LIB_DIR}" TOUCH)
endif()
add_library(BLAS::BLAS SHARED IMPORTED)
set_target_properties(BLAS::BLAS PROPERTIES
  IMPORTED_LOCATION "${LUTB_OPENBLAS_LIB_DIR}/libopenblas.so.0"
  INTERFACE_INCLUDE_DIRECTORIES "${dir}/include"
  INTERFACE_LINK_OPTIONS "LINKER:--disable-new-dtags")
# Where the shared libraries above live: the build tree's executables find them by their build
# RPATH; an installed module (the Python extension, python/CMakeLists.txt) is given these as its
# install RPATH.
set(LUTB_DEPS_RUNTIME_DIRS "${LUTB_DEPS_DIR}/hwy/lib" "${LUTB_OPENBLAS_LIB_DIR}")

if(LUTB_TESTS)
  lutb_dep_dir(dir googletest)
  include(FetchContent)
  set(BUILD_GMOCK OFF)
  set(INSTALL_GTEST OFF)
  FetchContent_Declare(googletest SOURCE_DIR "${dir}")
  FetchContent_MakeAvailable(googletest)
  # Its sources are not ours: GCC 12's -Wrestrict flags libstdc++ code inlined in gtest-all.cc.
  target_compile_options(gtest PRIVATE -w)
  target_compile_options(gtest_main PRIVATE -w)
endif()

if(LUTB_BENCH AND LUTB_BENCH_CPU)
  message(FATAL_ERROR "LUTB_DEPS_DIR holds no Google Benchmark: configure with -DLUTB_BENCH_CPU=OFF "
                      "(the GPU benchmarks need none)")
endif()
