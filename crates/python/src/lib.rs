//! `braid._braid`: the native part of the `braid` Python module.
//!
//! A thin layer over the `braid` crate: it turns Python objects into byte
//! ranges with a datatype (`views`), checks every argument before anything
//! is sent, runs the operation on braid's communicator with the GIL
//! released (`comm`), and turns braid's errors into Python exceptions
//! (`errors`). Asynchronous operations run in order on one worker thread
//! per communicator and return a handle (`work`). The Python package
//! (`python/braid`) adds the operator enum, the exception classes, the type
//! stubs and the `torch.distributed` backend on top.

mod comm;
mod cuda;
mod errors;
mod names;
mod uid;
mod views;
mod work;

use pyo3::prelude::*;

/// The datatypes braid has, as (code, name, size in bytes); the raw entry
/// points of the torch backend take the name (or the code).
#[pyfunction]
fn datatypes() -> Vec<(u8, &'static str, usize)> {
    braid::DataType::ALL
        .iter()
        .map(|d| (*d as u8, d.name(), d.size()))
        .collect()
}

/// The reduction operators, as (code, name): `braid.Op` is built from it.
#[pyfunction]
fn _operators() -> Vec<(u8, &'static str)> {
    braid::RedOp::ALL
        .iter()
        .map(|o| (*o as u8, o.name()))
        .collect()
}

/// The braid datatype of a buffer-protocol object or DLPack producer, by
/// braid's name (`float`, `half`, `bfloat16`, `int32`, ...); raises
/// `InvalidArgumentError` when it has none.
#[pyfunction]
fn datatype_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    views::View::new(obj, "buffer", false)
        .map(|v| v.dtype.name())
        .map_err(|e| e.to_py(py))
}

#[pymodule]
fn _braid(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<comm::PyComm>()?;
    m.add_class::<comm::PyGroup>()?;
    m.add_class::<uid::PyUniqueId>()?;
    m.add_class::<uid::PyRootSlot>()?;
    m.add_class::<work::Handle>()?;
    m.add_function(wrap_pyfunction!(datatypes, m)?)?;
    m.add_function(wrap_pyfunction!(datatype_of, m)?)?;
    m.add_function(wrap_pyfunction!(_operators, m)?)?;
    Ok(())
}
