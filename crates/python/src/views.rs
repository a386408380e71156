//! Python objects as byte ranges with a braid datatype: the buffer protocol
//! (numpy arrays, bytearray, memoryview, array.array) and DLPack producers
//! (torch tensors, and anything else with `__dlpack__`).
//!
//! Every check happens here, before anything is sent: contiguity, a
//! datatype braid has, writability of receive buffers, host memory.

use std::ffi::{c_char, c_void, CStr};
use std::ptr::NonNull;

use braid::DataType;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;

use crate::errors::ErrInfo;

/// A byte range of process memory (no lifetime: its owner keeps it alive).
/// Plain integers, so that jobs carrying it can move to a stream's thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Raw {
    pub addr: usize,
    pub len: usize,
}

impl Raw {
    fn base(&self) -> *mut u8 {
        if self.len == 0 || self.addr == 0 {
            NonNull::<u8>::dangling().as_ptr()
        } else {
            self.addr as *mut u8
        }
    }

    /// The bytes.
    ///
    /// # Safety
    ///
    /// The range must be live, readable memory for as long as the slice is
    /// used, and nobody may write to it meanwhile except through this call's
    /// own mutable views.
    pub(crate) unsafe fn slice<'a>(&self) -> &'a [u8] {
        // SAFETY: the caller guarantees the range is live; an empty range
        // uses a dangling, aligned, non-null pointer as slices require.
        unsafe { std::slice::from_raw_parts(self.base(), self.len) }
    }

    /// The bytes, writable.
    ///
    /// # Safety
    ///
    /// As [`Raw::slice`], writable, and not aliased by any other live slice.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(&self) -> &'a mut [u8] {
        // SAFETY: as in `slice`; the caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.len) }
    }

    pub(crate) fn end(&self) -> usize {
        self.addr + self.len
    }

    /// Whether the two ranges share a byte.
    pub(crate) fn overlaps(&self, o: &Raw) -> bool {
        self.len > 0 && o.len > 0 && self.addr < o.end() && o.addr < self.end()
    }
}

/// What keeps a view's memory alive.
enum Keep {
    /// A buffer-protocol export, released on drop.
    Buffer(Box<ffi::Py_buffer>),
    /// A DLPack capsule: its destructor calls the producer's deleter.
    Capsule(#[allow(dead_code)] Py<PyAny>),
    /// A torch tensor read directly (its storage lives while it does).
    Tensor(#[allow(dead_code)] Py<PyAny>),
}

/// A contiguous host buffer of one datatype, exported by a Python object.
pub(crate) struct View {
    pub raw: Raw,
    pub dtype: DataType,
    pub readonly: bool,
    keep: Keep,
}

// SAFETY: the export is only released with the GIL held (Drop attaches);
// the memory it describes is plain process memory.
unsafe impl Send for View {}
// SAFETY: a shared `&View` only reads the plain fields (`raw`, `dtype`,
// `readonly`); the export itself is touched only by `Drop`, which needs
// `&mut` and attaches to the interpreter.
unsafe impl Sync for View {}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("raw", &self.raw)
            .field("dtype", &self.dtype)
            .field("readonly", &self.readonly)
            .finish()
    }
}

impl Drop for View {
    fn drop(&mut self) {
        if let Keep::Buffer(b) = &mut self.keep {
            let b: *mut ffi::Py_buffer = &mut **b;
            Python::attach(|_| {
                // SAFETY: `b` was filled by a successful PyObject_GetBuffer
                // and is released exactly once, with the GIL held.
                unsafe { ffi::PyBuffer_Release(b) }
            });
        }
    }
}

impl View {
    /// The elements of this view.
    pub(crate) fn count(&self) -> usize {
        self.raw.len / self.dtype.size()
    }

    /// `obj` as a buffer for `what` ("sendbuf", "recvbuf", ...); `write`
    /// when braid will write into it.
    pub(crate) fn new(obj: &Bound<'_, PyAny>, what: &str, write: bool) -> Result<View, ErrInfo> {
        // SAFETY: `obj` is a live object and the GIL is held.
        let has_buffer = unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0;
        let v = if has_buffer {
            Self::from_buffer(obj, what)?
        } else if let Some(v) = Self::from_torch(obj, what) {
            v?
        } else if obj.hasattr("__dlpack__").unwrap_or(false) {
            Self::from_dlpack(obj, what)?
        } else {
            return Err(ErrInfo::invalid(format!(
                "{what}: a {} is neither a buffer (numpy array, bytearray, memoryview) nor a DLPack producer (torch tensor)",
                type_name(obj)
            )));
        };
        if write && v.readonly {
            return Err(ErrInfo::invalid(format!(
                "{what}: the {} is read-only, and braid writes the result into it; pass a writable buffer",
                type_name(obj)
            )));
        }
        Ok(v)
    }

    fn from_buffer(obj: &Bound<'_, PyAny>, what: &str) -> Result<View, ErrInfo> {
        // SAFETY: Py_buffer is a plain C struct; all-zero is its unfilled
        // state, which PyObject_GetBuffer overwrites.
        let mut b: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: GIL held; `b` is valid for writes.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *b, ffi::PyBUF_RECORDS_RO) };
        if rc != 0 {
            let cause = PyErr::take(obj.py())
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(ErrInfo::invalid(format!(
                "{what}: the {} does not export its memory: {cause}",
                type_name(obj)
            )));
        }
        // SAFETY: `b` is a filled export; 'C' asks for row-major contiguity.
        let contiguous = unsafe { ffi::PyBuffer_IsContiguous(&*b, b'C' as c_char) } != 0;
        let format = if b.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-null format is a NUL-terminated string owned by
            // the export, which is still held.
            unsafe { CStr::from_ptr(b.format) }
                .to_string_lossy()
                .into_owned()
        };
        let itemsize = b.itemsize.max(0) as usize;
        // From here on the view owns the export and releases it on every path.
        let mut view = View {
            raw: Raw {
                addr: b.buf as usize,
                len: b.len.max(0) as usize,
            },
            dtype: DataType::U8,
            readonly: b.readonly != 0,
            keep: Keep::Buffer(b),
        };
        if !contiguous {
            return Err(ErrInfo::invalid(format!(
                "{what}: the {} is not contiguous; pass a contiguous copy (numpy.ascontiguousarray, tensor.contiguous())",
                type_name(obj)
            )));
        }
        view.dtype = buffer_dtype(&format, itemsize).map_err(|why| {
            ErrInfo::invalid(format!("{what}: {} elements: {why}", type_name(obj)))
        })?;
        Ok(view)
    }

    /// A plain torch tensor (CPU, dense, contiguous, a braid datatype, no
    /// autograd or conjugate view) read from its own attributes: torch's
    /// `__dlpack__` costs about 4 µs a call, more than a small collective.
    /// Anything else is None, and goes through DLPack, whose checks give
    /// the errors; a negative view (which DLPack exports as its memory,
    /// the negated values) is an error here.
    fn from_torch(obj: &Bound<'_, PyAny>, what: &str) -> Option<Result<View, ErrInfo>> {
        let py = obj.py();
        let torch = TORCH.get(py).or_else(|| Torch::load(py))?;
        if !obj.is_instance(torch.tensor.bind(py)).ok()? {
            return None;
        }
        // Interned names: building the name strings cost as much as the reads.
        fn get<'py>(
            o: &Bound<'py, PyAny>,
            name: &Bound<'py, PyString>,
        ) -> Option<Bound<'py, PyAny>> {
            o.getattr(name).ok()
        }
        let flag = |name| get(obj, name)?.is_truthy().ok();
        let call = |name: &Bound<'_, PyString>| obj.call_method0(name).ok()?.is_truthy().ok();
        if call(intern!(py, "is_neg"))? {
            return Some(Err(ErrInfo::invalid(format!(
                "{what}: the tensor is a negative view (its memory holds the negated values); pass tensor.resolve_neg()"
            ))));
        }
        if !flag(intern!(py, "is_cpu"))?
            || flag(intern!(py, "requires_grad"))?
            || !call(intern!(py, "is_contiguous"))?
            || !get(obj, intern!(py, "layout"))?.is(torch.strided.bind(py))
            || call(intern!(py, "is_conj"))?
        {
            return None;
        }
        let dt = get(obj, intern!(py, "dtype"))?;
        let dtype = torch
            .dtypes
            .iter()
            .find(|(d, _)| dt.is(d.bind(py)))
            .map(|&(_, t)| t)?;
        let addr: usize = obj
            .call_method0(intern!(py, "data_ptr"))
            .ok()?
            .extract()
            .ok()?;
        let len: usize = get(obj, intern!(py, "nbytes"))?.extract().ok()?;
        Some(Ok(View {
            raw: Raw { addr, len },
            dtype,
            readonly: false,
            keep: Keep::Tensor(obj.clone().unbind()),
        }))
    }

    fn from_dlpack(obj: &Bound<'_, PyAny>, what: &str) -> Result<View, ErrInfo> {
        let bad = |why: String| ErrInfo::invalid(format!("{what}: {}: {why}", type_name(obj)));
        if let Ok(dev) = obj.call_method0("__dlpack_device__") {
            if let Ok((kind, id)) = dev.extract::<(i32, i32)>() {
                if kind != DL_CPU && kind != DL_CUDA_HOST {
                    return Err(bad(format!(
                        "it lives in {} memory (DLPack device {kind}, {id}); braid's Python API takes host memory (for CUDA tensors use the torch backend, which hands them to braid's CUDA communicator)",
                        dl_device_name(kind)
                    )));
                }
            }
        }
        let cap = obj
            .call_method0("__dlpack__")
            .map_err(|e| bad(format!("__dlpack__() failed: {e}")))?;
        // SAFETY: GIL held; a wrong name or a non-capsule gives null with an
        // exception set.
        let p = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dltensor".as_ptr()) };
        if p.is_null() {
            let cause = PyErr::take(obj.py())
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(bad(format!(
                "__dlpack__() did not return a DLPack capsule: {cause}"
            )));
        }
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor that stays
        // valid while the capsule is alive and unconsumed (we keep it, and
        // never rename it, so its destructor frees the tensor).
        let t = unsafe { &(*(p as *const DLManagedTensor)).dl_tensor };
        if t.device.device_type != DL_CPU && t.device.device_type != DL_CUDA_HOST {
            return Err(bad(format!(
                "it lives in {} memory; braid's Python API takes host memory",
                dl_device_name(t.device.device_type)
            )));
        }
        let dtype = dl_dtype(t.dtype).map_err(bad)?;
        let ndim = t.ndim.max(0) as usize;
        let shape: &[i64] = if ndim == 0 || t.shape.is_null() {
            &[]
        } else {
            // SAFETY: DLPack: `shape` holds `ndim` entries.
            unsafe { std::slice::from_raw_parts(t.shape, ndim) }
        };
        let strides: Option<&[i64]> = if ndim == 0 || t.strides.is_null() {
            None
        } else {
            // SAFETY: DLPack: non-null `strides` holds `ndim` entries.
            Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
        };
        let mut numel: usize = 1;
        for &d in shape {
            numel = numel.saturating_mul(d.max(0) as usize);
        }
        if let Some(strides) = strides {
            let mut want: i64 = 1;
            for (&d, &s) in shape.iter().zip(strides).rev() {
                if d > 1 && s != want {
                    return Err(bad(format!(
                        "it is not contiguous (shape {shape:?}, strides {strides:?}); pass a contiguous copy (tensor.contiguous())"
                    )));
                }
                want = want.saturating_mul(d.max(1));
            }
        }
        let addr = (t.data as usize).wrapping_add(t.byte_offset as usize);
        Ok(View {
            raw: Raw {
                addr,
                len: numel * dtype.size(),
            },
            dtype,
            readonly: false,
            keep: Keep::Capsule(cap.unbind()),
        })
    }
}

/// What [`View::from_torch`] compares with, read once torch is imported
/// (braid never imports it).
struct Torch {
    tensor: Py<PyAny>,
    strided: Py<PyAny>,
    dtypes: Vec<(Py<PyAny>, DataType)>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

impl Torch {
    /// Torch's objects, if torch is imported; None (and looked up again on
    /// the next call) if it is not.
    fn load(py: Python<'_>) -> Option<&'static Torch> {
        let modules = py.import("sys").ok()?.getattr("modules").ok()?;
        let torch = modules.get_item("torch").ok()?;
        let names = [
            ("int8", DataType::I8),
            ("uint8", DataType::U8),
            ("int32", DataType::I32),
            ("uint32", DataType::U32),
            ("int64", DataType::I64),
            ("uint64", DataType::U64),
            ("float16", DataType::F16),
            ("bfloat16", DataType::Bf16),
            ("float32", DataType::F32),
            ("float64", DataType::F64),
        ];
        let t = Torch {
            tensor: torch.getattr("Tensor").ok()?.unbind(),
            strided: torch.getattr("strided").ok()?.unbind(),
            // Older torch has no uint32/uint64: those go through DLPack.
            dtypes: names
                .iter()
                .filter_map(|&(n, d)| Some((torch.getattr(n).ok()?.unbind(), d)))
                .collect(),
        };
        Some(TORCH.get_or_init(py, || t))
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// The datatype of a buffer-protocol format string (struct module syntax)
/// with element size `itemsize`.
fn buffer_dtype(format: &str, itemsize: usize) -> Result<DataType, String> {
    let body = match format.as_bytes().first() {
        Some(b'@' | b'=') => &format[1..],
        Some(b'<') if cfg!(target_endian = "little") => &format[1..],
        Some(b'>' | b'!') if cfg!(target_endian = "little") => {
            return Err(format!(
                "format {format:?} is big-endian; braid reduces native-endian numbers (numpy: arr.astype(arr.dtype.newbyteorder('=')))"
            ))
        }
        _ => format,
    };
    let int = |size: usize, signed: bool| match (size, signed) {
        (1, true) => Some(DataType::I8),
        (1, false) => Some(DataType::U8),
        (4, true) => Some(DataType::I32),
        (4, false) => Some(DataType::U32),
        (8, true) => Some(DataType::I64),
        (8, false) => Some(DataType::U64),
        _ => None,
    };
    let dt = match body {
        "b" => Some(DataType::I8),
        "B" | "c" => Some(DataType::U8),
        "h" | "i" | "l" | "q" | "n" => int(itemsize, true),
        "H" | "I" | "L" | "Q" | "N" => int(itemsize, false),
        "e" => Some(DataType::F16),
        "f" => Some(DataType::F32),
        "d" => Some(DataType::F64),
        _ => None,
    };
    match dt {
        Some(d) if d.size() == itemsize => Ok(d),
        _ => Err(format!(
            "format {format:?} ({itemsize}-byte items) is not a braid datatype; braid has int8, uint8, int32, uint32, int64, uint64, float16, bfloat16 (through DLPack), float32 and float64"
        )),
    }
}

// DLPack (dlpack.h, v0.8+ legacy capsule "dltensor").
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

fn dl_device_name(kind: i32) -> &'static str {
    match kind {
        DL_CUDA => "CUDA device",
        4 => "OpenCL",
        7 => "Vulkan",
        8 => "Metal",
        10 => "ROCm device",
        13 => "CUDA managed",
        _ => "non-host",
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

fn dl_dtype(t: DLDataType) -> Result<DataType, String> {
    let d = match (t.code, t.bits, t.lanes) {
        (0, 8, 1) => Some(DataType::I8),
        (0, 32, 1) => Some(DataType::I32),
        (0, 64, 1) => Some(DataType::I64),
        (1, 8, 1) => Some(DataType::U8),
        (1, 32, 1) => Some(DataType::U32),
        (1, 64, 1) => Some(DataType::U64),
        (2, 16, 1) => Some(DataType::F16),
        (2, 32, 1) => Some(DataType::F32),
        (2, 64, 1) => Some(DataType::F64),
        (4, 16, 1) => Some(DataType::Bf16),
        _ => None,
    };
    d.ok_or_else(|| {
        let kind = match t.code {
            0 => "int",
            1 => "uint",
            2 => "float",
            4 => "bfloat",
            5 => "complex",
            6 => "bool",
            _ => "type code",
        };
        format!(
            "elements of {kind}{} (lanes {}) are not a braid datatype; braid has int8, uint8, int32, uint32, int64, uint64, float16, bfloat16, float32 and float64",
            t.bits, t.lanes
        )
    })
}
