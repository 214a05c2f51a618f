pub mod bench;
pub mod doctor;
pub mod run;
pub mod setup;
