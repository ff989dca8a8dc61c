// pybind11 bindings for pflcore._core_cuda: argument checks and dispatch only, the math lives
// in csrc/cuda/. Python passes raw device pointers (tensor.data_ptr()) and the CUDA stream
// handle (torch.cuda.current_stream().cuda_stream) as ints.

#include <pybind11/pybind11.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#ifndef PFLCORE_CUDA_ARCHS
#define PFLCORE_CUDA_ARCHS "unknown"
#endif

namespace py = pybind11;

namespace pflcore::cuda {
// Defined in csrc/cuda/kmeans.cu.
cudaError_t kmeans_assign(const float* points, const float* centroids, int64_t* labels,
                          float* sqdist, int64_t N, int64_t K, int64_t d, cudaStream_t stream);
cudaError_t kmeans_assign(const double* points, const double* centroids, int64_t* labels,
                          double* sqdist, int64_t N, int64_t K, int64_t d, cudaStream_t stream);
}  // namespace pflcore::cuda

namespace {

void require_pointer(std::uintptr_t p, const char* name) {
    if (p == 0) throw py::value_error(std::string("kmeans_assign: ") + name + " is a null pointer");
}

template <typename T>
cudaError_t dispatch_kmeans_assign(std::uintptr_t points, std::uintptr_t centroids,
                                   std::uintptr_t labels, std::uintptr_t sqdist, int64_t N,
                                   int64_t K, int64_t d, std::uintptr_t stream) {
    return pflcore::cuda::kmeans_assign(
        reinterpret_cast<const T*>(points), reinterpret_cast<const T*>(centroids),
        reinterpret_cast<int64_t*>(labels), reinterpret_cast<T*>(sqdist), N, K, d,
        reinterpret_cast<cudaStream_t>(stream));
}

void kmeans_assign(std::uintptr_t points, std::uintptr_t centroids, std::uintptr_t labels,
                   std::uintptr_t sqdist, int64_t N, int64_t K, int64_t d,
                   const std::string& dtype, std::uintptr_t stream) {
    if (N < 0) throw py::value_error("kmeans_assign: N must be >= 0, got " + std::to_string(N));
    if (K < 1) throw py::value_error("kmeans_assign: K must be >= 1, got " + std::to_string(K));
    if (d < 1) throw py::value_error("kmeans_assign: d must be >= 1, got " + std::to_string(d));
    const bool f32 = dtype == "float32";
    if (!f32 && dtype != "float64")
        throw py::value_error("kmeans_assign: dtype must be 'float32' or 'float64', got '" +
                              dtype + "'");
    if (N > 0) {
        require_pointer(points, "points");
        require_pointer(centroids, "centroids");
        require_pointer(labels, "labels");
        require_pointer(sqdist, "sqdist");
    }

    cudaError_t err;
    {
        py::gil_scoped_release nogil;
        err = f32 ? dispatch_kmeans_assign<float>(points, centroids, labels, sqdist, N, K, d, stream)
                  : dispatch_kmeans_assign<double>(points, centroids, labels, sqdist, N, K, d, stream);
    }
    if (err != cudaSuccess)
        throw std::runtime_error(std::string("kmeans_assign: CUDA error: ") +
                                 cudaGetErrorString(err));
}

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the error so it is not reported by a later call
        return 0;
    }
    return n;
}

py::dict build_info() {
    int version = 0;
    if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
        cudaGetLastError();
        version = -1;
    }
    py::list ops;
    ops.append("kmeans_assign");
    py::dict info;
    info["cuda_runtime_version"] = version;
    info["architectures"] = std::string(PFLCORE_CUDA_ARCHS);
    info["ops"] = ops;
    return info;
}

}  // namespace

PYBIND11_MODULE(_core_cuda, m) {
    m.doc() =
        "pflcore CUDA kernels (no libtorch). Tensors are passed as raw device pointers "
        "(tensor.data_ptr()) with their sizes, a dtype name and the CUDA stream handle "
        "(torch.cuda.current_stream().cuda_stream); kernels are launched asynchronously on "
        "that stream. The caller guarantees contiguous tensors on the current device.";

    m.def("kmeans_assign", &kmeans_assign, py::arg("points"), py::arg("centroids"),
          py::arg("labels"), py::arg("sqdist"), py::arg("N"), py::arg("K"), py::arg("d"),
          py::arg("dtype"), py::arg("stream"),
          "k-means assignment: labels[i] = argmin_k sum_j (points[i,j] - centroids[k,j])^2 "
          "(ties to the lowest k) and sqdist[i] = that minimum.\n"
          "points [N, d] and centroids [K, d] are contiguous float32/float64 (dtype), labels "
          "[N] is int64, sqdist [N] has the dtype of points. N >= 0, K >= 1, d >= 1.");
    m.def("device_count", &device_count,
          "Number of visible CUDA devices; 0 when there is none or no usable driver.");
    m.def("build_info", &build_info,
          "Dict with cuda_runtime_version (int, -1 on error), architectures (the CUDA "
          "architectures compiled for) and ops (the op names this module implements).");
}
