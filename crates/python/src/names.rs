//! Datatypes and reduction operators from Python: the one place where they
//! cross into braid, by name (what the torch backend passes, and
//! `braid.Op`'s names) or by braid's own code (`datatypes()`, `braid.Op`'s
//! values, both read from braid's tables), so no table is kept twice.

use braid::{DataType, RedOp};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors::invalid;

/// The datatype: its name (every name braid's `DataType` parses: `"float"`,
/// `"float32"`, `"half"`, `"bfloat16"`, `"int64"`, ...) or its code in
/// `datatypes()`.
pub(crate) fn data_type(py: Python<'_>, dt: &Bound<'_, PyAny>) -> PyResult<DataType> {
    // A name is tried first, without a failed conversion (raising and
    // dropping a TypeError cost more than the rest of a small call).
    if let Ok(name) = dt.cast::<PyString>() {
        if let Some(d) = name.to_str().ok().and_then(|n| n.trim().parse().ok()) {
            return Ok(d);
        }
    } else if let Ok(code) = dt.extract::<i64>() {
        if let Some(d) = u8::try_from(code).ok().and_then(DataType::from_u8) {
            return Ok(d);
        }
    }
    Err(invalid(
        py,
        format!(
            "datatype {} is not a braid datatype: use a name from braid.datatypes() ({})",
            dt.repr().map(|r| r.to_string()).unwrap_or_default(),
            DataType::ALL.map(|d| d.name()).join(", ")
        ),
    ))
}

/// The operator of a raw entry point (None: Sum).
pub(crate) fn opt_op(py: Python<'_>, op: Option<&Bound<'_, PyAny>>) -> PyResult<RedOp> {
    op.map_or(Ok(RedOp::Sum), |o| red_op(py, o))
}

/// The operator: a `braid.Op`, its integer value, or its name.
pub(crate) fn red_op(py: Python<'_>, op: &Bound<'_, PyAny>) -> PyResult<RedOp> {
    if let Ok(name) = op.cast::<PyString>() {
        if let Some(o) = name.to_str().ok().and_then(|n| {
            RedOp::ALL
                .iter()
                .find(|o| o.name().eq_ignore_ascii_case(n.trim()))
        }) {
            return Ok(*o);
        }
    } else if let Ok(code) = op.extract::<i64>() {
        if let Some(o) = u8::try_from(code).ok().and_then(RedOp::from_u8) {
            return Ok(o);
        }
    }
    Err(invalid(
        py,
        format!(
            "op {} is not a braid operator: use braid.Op.SUM, PROD, MIN, MAX or AVG (or their names)",
            op.repr().map(|r| r.to_string()).unwrap_or_default()
        ),
    ))
}
