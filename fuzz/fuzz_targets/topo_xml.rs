#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| braid_fuzz::topo_xml(data));
