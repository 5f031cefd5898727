// The functions of the CUDA driver, NVRTC and torch's CUDA shim that the CUDA operator calls,
// as pointers handed over at run time (fasthooks/cuda_setup.py finds the libraries and resolves
// each name of kApiNames). So the binary links no CUDA library, loads under a CPU build of torch,
// and compiles its kernels with the NVRTC of whichever CUDA torch it runs beside.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fasthooks {
namespace cuda {

// The driver API's handles and codes, as cuda.h declares them.
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
constexpr CUresult kCudaSuccess = 0;
constexpr int kAttributeMultiprocessors = 16;
constexpr int kAttributeMajor = 75;
constexpr int kAttributeMinor = 76;
constexpr int kCaptureStatusNone = 0;
constexpr int kCaptureModeRelaxed = 2;

using nvrtcProgram = struct _nvrtcProgram*;
using nvrtcResult = int;

struct CudaApi {
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**);
  CUresult (*cuStreamIsCapturing)(CUstream, int*);
  CUresult (*cuThreadExchangeStreamCaptureMode)(int*);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  nvrtcResult (*nvrtcVersion)(int*, int*);
  nvrtcResult (*nvrtcGetNumSupportedArchs)(int*);
  nvrtcResult (*nvrtcGetSupportedArchs)(int*);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int,
                                    const char* const*, const char* const*);
  nvrtcResult (*nvrtcAddNameExpression)(nvrtcProgram, const char*);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetPTX)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetLoweredName)(nvrtcProgram, const char*, const char**);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram*);
  const char* (*nvrtcGetErrorString)(nvrtcResult);
  int32_t (*aoti_torch_get_current_cuda_stream)(int32_t, void**);
};

// The names of CudaApi's members, in order: what fasthooks_cuda_setup's table holds. The driver's
// come first (kDriverNames of them), then NVRTC's; the last is torch's.
constexpr const char* kApiNames[] = {
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    "cuLaunchKernel",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
    "cuGetErrorString",
    "nvrtcVersion",
    "nvrtcGetNumSupportedArchs",
    "nvrtcGetSupportedArchs",
    "nvrtcCreateProgram",
    "nvrtcAddNameExpression",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetLoweredName",
    "nvrtcDestroyProgram",
    "nvrtcGetErrorString",
    "aoti_torch_get_current_cuda_stream",
};
constexpr size_t kApiFunctions = sizeof(kApiNames) / sizeof(kApiNames[0]);
static_assert(sizeof(CudaApi) == kApiFunctions * sizeof(void*), "one name per CudaApi member");

}  // namespace cuda
}  // namespace fasthooks
