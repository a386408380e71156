//! Launch environment (to be written).
